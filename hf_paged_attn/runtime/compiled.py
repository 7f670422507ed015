"""A compiled forward for the CPU: the model's forward through ``torch.compile`` (inductor), as vLLM
compiles its models, with the paged attention left to the compiler as one opaque op.

``CompiledExecutor`` wraps a ``LocalExecutor``. A step's packed token axis is padded to a *shape
bucket* (``token_buckets``: a handful of sizes that cover every step), so a few compiled graphs
serve every step; each bucket compiles once, the first time a step of that size comes, and the
graphs are kept per model (``compiled_model``), so a second engine (a second ``model.generate``) on
the same model compiles nothing. Inductor's on-disk cache makes a later process's compiles short.

What the graph sees:

- ``input_ids`` / ``position_ids`` [1, M] (``M`` the bucket) and ``logits_indices`` [S] (marked
  dynamic: how many rows a step samples varies apart from its size);
- a ``StepCache`` in place of the paged cache, whose ``update`` hands K/V through, and the constant
  ``COMPILED`` as the ``paged_forward`` kwarg: nothing in the graph depends on the step, so the
  graph never guards on (and recompiles for) a step's Python numbers or its ``ForwardContext``;
- each layer's attention as ``hf_paged_attn::step_attention`` (``attention/function.py``), which
  reaches the step through ``COMPILED_STEP`` and runs the eager kernels on the real rows.

Padding rows (the bucket's rows after the step's) are harmless: the attention op never lets them
touch the cache and returns zeros for them; every other op of a decoder is row-wise (projections,
norms, rotary, MLP), so they cannot change a real row; their logits are never taken.

What runs eagerly instead: the first step of an engine (it confirms each layer's window and runs
the model checks, ``check_attention_call``, that the graph skips), steps wider than the largest
bucket, and everything once a compile has failed (logged, as a failed CUDA graph capture is).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import Cache

from ..attention.cache import PagedLayer
from ..attention.forward import ForwardContext
from ..attention.function import COMPILED, COMPILED_STEP, CompiledStep
from ..attention.step import StepMetadata
from ..core.layers import LayerKinds

if TYPE_CHECKING:
    from .executor import LocalExecutor

logger = logging.getLogger(__name__)

# Inductor options of the compiled forward, patched around every call (a compile may come at any
# call; ``torch.compile(options=)`` does not apply ``freezing``). ``freezing`` folds the weights into
# the graph as constants, so inductor prepacks them for oneDNN: with a dynamic token count also in
# fp32, where MKL's sgemm runs 2-3x slower on this AMD CPU (benchmarks/README.md, compiled forward).
INDUCTOR_OPTIONS: dict[str, object] = {"freezing": True}
SKIP_GUARDS = os.environ.get("HF_PAGED_ATTN_SKIP_GUARDS", "1") != "0"
RECOMPILE_LIMIT = 64  # dynamo's graphs per code object: buckets x models share one function


def token_buckets(max_batch_tokens: int, smallest: int = 2) -> list[int]:
    """Packed-token sizes that get a graph: powers of two from ``smallest`` up, then
    ``max_batch_tokens``. A step pads to the first that holds it (at most 2x its rows, and decode
    steps of a few requests, the common case, pad by a row or two). ``smallest`` >= 2: dynamo
    specialises a size of 1, so a bucket of one row would compile apart from the dynamic one."""
    sizes, size = [], smallest
    while size < max_batch_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_tokens]


class StepCache(Cache):
    """The cache the compiled graph sees: ``update`` returns K/V as they are (the attention op
    writes them into the real pages), lengths are per request (0, as ``PagedAttentionCache``)."""

    def __init__(self, windows: list[int | None]) -> None:
        super().__init__(layers=[PagedLayer(0, 1, is_sliding=w is not None) for w in windows])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return 0, 0


@dataclass(slots=True)
class CompiledModel:
    """One model's compiled forward, shared by every engine on the model (``compiled_model``)."""

    forward: object  # torch.compile'd: (input_ids [1, M], position_ids [1, M], logits_indices [S]) -> logits
    modules: dict[int, torch.nn.Module]  # layer_idx -> attention module
    shapes: set[int | None] = field(default_factory=set)  # buckets compiled so far (None: the dynamic graph)
    failed: str | None = None  # why a compile failed: then this model runs eagerly
    compile_seconds: float = 0.0


_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, CompiledModel] = weakref.WeakKeyDictionary()


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module] | None:
    """``layer_idx`` -> attention module, or None when the model's layer indices are not one per
    layer (models that reuse or offset layers, which the op could not address by index)."""
    modules = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "config") and any(
            hasattr(module, name) for name in ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
        ):
            if idx in modules:
                return None
            modules[idx] = module
    return modules or None


def compiled_model(model: torch.nn.Module, windows: list[int | None]) -> CompiledModel | None:
    """``model``'s compiled forward, made once per model (None: its layers can't be addressed)."""
    found = _MODELS.get(model)
    if found is not None:
        return found
    modules = attention_modules(model)
    if modules is None or sorted(modules) != list(range(len(windows))):
        return None
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    model_ref = weakref.ref(model)  # the compiled function must not keep the model alive
    cache = StepCache(windows)

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        out = model_ref()(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True,
                          paged_forward=COMPILED, logits_to_keep=logits_indices)  # fmt: skip
        return out.logits[0]

    found = _MODELS[model] = CompiledModel(torch.compile(forward), modules)
    return found


class CompiledExecutor:
    """Steps through ``model``'s compiled forward; the others through ``eager``.

    ``buckets``: None (the default) compiles one graph whose token count is dynamic (steps of one
    row pad to two: dynamo specialises a size of 1); a list of sizes compiles one static graph per
    size (``token_buckets``), padding each step to the first that holds it. ``num_compiles`` counts
    the compiles this executor ran (a second engine on the same model runs none).
    """

    def __init__(self, eager: LocalExecutor, layers: LayerKinds, buckets: list[int] | None = None) -> None:
        self.eager = eager
        self.layers = layers
        self.buckets = buckets
        self.compiled = compiled_model(eager.model, layers.windows)
        self.num_compiles = 0
        self.num_compiled_steps = 0

    @property
    def failed(self) -> str | None:
        return "the model's layers can't be addressed by layer_idx" if self.compiled is None else self.compiled.failed

    def rows_for(self, step: StepMetadata) -> int | None:
        """The packed rows ``step`` runs at, or None when it runs eagerly."""
        if self.failed is not None or not self.layers.observed or step.has_beams:
            return None
        if self.buckets is None:
            return max(step.num_tokens, 2)
        return next((b for b in self.buckets if b >= step.num_tokens), None)

    def execute(self, step: StepMetadata) -> torch.Tensor:
        """Logits of the step's sampled rows, [num_sampled, vocab] float32."""
        rows = self.rows_for(step)
        if rows is None:
            return self.eager.execute(step)
        self.eager.prepare(step)
        shape = None if self.buckets is None else rows
        if shape in self.compiled.shapes:
            return self._run(step, rows)
        return self._compile(step, rows, shape)

    def _compile(self, step: StepMetadata, rows: int, shape: int | None) -> torch.Tensor:
        """The first step of a shape: compiles it (logged); on failure every step of this model
        runs eagerly from now on (logged), this one included."""
        what = "any number of tokens" if shape is None else f"steps of up to {shape} tokens"
        logger.info("compiling the model's forward for %s (once per model; cached on disk for later runs)", what)
        start = time.perf_counter()
        try:
            logits = self._run(step, rows)
        except Exception as exc:
            self.compiled.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("compiling the model's forward failed (%s); steps run eagerly", self.compiled.failed)
            return self.eager.forward(step)  # K/V rewrites are idempotent: same slots, same values
        seconds = time.perf_counter() - start
        self.compiled.shapes.add(shape)
        self.compiled.compile_seconds += seconds
        self.num_compiles += 1
        logger.info("compiled the model's forward for %s in %.1f s", what, seconds)
        return logits

    @torch.inference_mode()
    def _run(self, step: StepMetadata, rows: int) -> torch.Tensor:
        n = step.num_tokens
        input_ids, position_ids = step.input_ids, step.position_ids
        if n < rows:  # padding rows: token 0 at position 0
            input_ids = torch.nn.functional.pad(input_ids, (0, rows - n))
            position_ids = torch.nn.functional.pad(position_ids, (0, rows - n))
        indices = step.logits_indices
        num_sampled = indices.numel()
        if num_sampled < 2:  # dynamo specialises sizes 0 and 1: sample at least two rows
            indices = torch.nn.functional.pad(indices, (0, 2 - num_sampled))
        torch._dynamo.maybe_mark_dynamic(indices, 0)
        if self.buckets is None:
            torch._dynamo.maybe_mark_dynamic(input_ids, 1)
            torch._dynamo.maybe_mark_dynamic(position_ids, 1)
        else:  # one graph per bucket: automatic dynamic shapes would make the second bucket's dynamic
            torch._dynamo.mark_static(input_ids, 1)
            torch._dynamo.mark_static(position_ids, 1)
        context = ForwardContext(step, self.eager.backend)
        token = COMPILED_STEP.set(CompiledStep(context, self.eager.cache, self.compiled.modules, n))
        try:
            with self.eager.cache.forward(context), torch._inductor.config.patch(INDUCTOR_OPTIONS), self._guards():
                logits = self.compiled.forward(input_ids, position_ids, indices)
        finally:
            COMPILED_STEP.reset(token)
        self.num_compiled_steps += 1
        return logits[:num_sampled].float()

    def _guards(self):  # noqa: ANN202
        """Once the graph exists, dynamo checks only the guards that tell its graphs apart (not
        every parameter and module attribute of the model: ~0.2-0.4 ms a step here)."""
        if SKIP_GUARDS and self.compiled.shapes:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
