"""vLLM-style paged attention and continuous batching behind ``attn_implementation="paged"``.

Importing the package registers ``"paged"`` with transformers.
"""

# First, before anything imports torch: importing _env applies the commands' environment defaults
# (OMP_WAIT_POLICY=PASSIVE for hf-paged-attn and python -m hf_paged_attn.demo/.bench; no-op for a library import).
from . import _env  # noqa: F401  # isort: split
from .attention.cache import PagedAttentionCache
from .core.request import RequestOutput, TokenLogprob
from .integration.register import register
from .runtime.background import EngineThread
from .runtime.config import PagedConfig
from .runtime.engine import ContinuousBatchingEngine
from .runtime.generation.params import SamplingParams
from .runtime.multimodal import MultimodalInputs
from .runtime.speculative.config import SpeculativeConfig
from .runtime.stats import EngineStats

__all__ = [
    "ContinuousBatchingEngine",
    "EngineStats",
    "EngineThread",
    "MultimodalInputs",
    "PagedAttentionCache",
    "PagedConfig",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "TokenLogprob",
    "register",
]
__version__ = "0.1.0"

register()
