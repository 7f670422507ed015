"""vLLM-style paged attention and continuous batching behind ``attn_implementation="paged"``.

Importing the package registers ``"paged"`` with transformers.
"""

from .cache import PagedAttentionCache
from .config import PagedConfig
from .engine import ContinuousBatchingEngine
from .integration import register
from .request import RequestOutput, TokenLogprob
from .stats import EngineStats

__all__ = [
    "ContinuousBatchingEngine",
    "EngineStats",
    "PagedAttentionCache",
    "PagedConfig",
    "RequestOutput",
    "TokenLogprob",
    "register",
]
__version__ = "0.1.0"

register()
