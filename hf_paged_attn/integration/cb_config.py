"""transformers' ``ContinuousBatchingConfig`` read as our ``PagedConfig``.

Every field of the config is one of three kinds, and a field that appears in a later transformers
release is refused until it is classified here:

* mapped: it has a meaning in our engine (page size, blocks, budgets, prefix sharing, scheduler,
  seed, CUDA graphs, log-probs, per-request processors);
* a no-op: it tunes how transformers' own engine runs (compile, async double-buffering, padding
  granularity of its graphs, CPU offloading instead of recompute, NCCL, queue sizes, ...) and
  changes no output here, so any value is accepted;
* refused: a value other than the default that we cannot honour raises NotImplementedError naming
  the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from transformers.generation import ContinuousBatchingConfig

from ..runtime.config import PagedConfig

# Fields that change no output of our engine: accepted whatever their value.
NO_OP_FIELDS = frozenset(
    {
        "max_memory_percent",  # mapped below, but only where the cache is sized from memory
        "max_blocks_per_request",  # sizes transformers' fast-decode block table
        "use_async_batching",  # transformers' double buffering
        "q_padding_interval_size",  # padding granularity of transformers' graphs
        "kv_padding_interval_size",
        "varlen_compile_config",  # torch.compile of transformers' two paths
        "decode_compile_config",
        "default_compile_level",
        "safety_margin",  # when transformers stops admitting prefills
        "auto_switch_to_flash",  # our attention is "paged" by definition
        "cpu_offload_space",  # transformers swaps K/V to the host; we recompute: the same tokens
        "cpu_offload_space_safety_threshold",
        "max_queue_size",  # backpressure of transformers' input queue
        "drop_unsupported_processors",  # every processor generate builds runs here
        "disable_nccl_graph_mixing",
        "cpu_group_timeout",
        "use_default_compile_configs",  # deprecated in transformers
        "max_cached_graphs",  # deprecated in transformers
    }
)
MAPPED_FIELDS = frozenset(
    {
        "page_size",
        "block_size",
        "num_blocks",
        "max_batch_tokens",
        "max_requests_per_batch",
        "allow_block_sharing",
        "scheduler_type",
        "seed",
        "use_cuda_graph",
        "return_logprobs",
        "per_request_processors",
    }
)
SCHEDULERS = {"fifo": "fcfs", "fcfs": "fcfs", "priority": "priority"}  # transformers' name -> our policy


@dataclass(frozen=True, slots=True)
class CBOptions:
    """What the config asks of the requests rather than of the cache."""

    return_logprobs: bool = False
    per_request_processors: bool = False


def paged_config_from(
    cb: ContinuousBatchingConfig | None, base: PagedConfig | None = None
) -> tuple[PagedConfig, CBOptions]:
    """(the ``PagedConfig`` for ``cb``, built on ``base``; the per-request options). NotImplementedError
    names a field we cannot honour; ValueError a value ``PagedConfig`` refuses."""
    base = base or PagedConfig()
    if cb is None:
        return base, CBOptions()
    defaults = ContinuousBatchingConfig()
    for f in fields(cb):
        if f.name in MAPPED_FIELDS or f.name in NO_OP_FIELDS:
            continue
        if getattr(cb, f.name) != getattr(defaults, f.name):
            raise NotImplementedError(
                f"ContinuousBatchingConfig.{f.name}={getattr(cb, f.name)!r} has no equivalent in the paged engine"
            )
    changes: dict[str, object] = {}
    page_size = cb.block_size if cb.block_size is not None else cb.page_size
    if page_size != defaults.page_size:  # left at transformers' default: the kernel's own block size
        changes["block_size"] = page_size
    if cb.num_blocks is not None:
        changes["num_blocks"] = cb.num_blocks
    if cb.max_batch_tokens is not None:
        changes["max_batch_tokens"] = cb.max_batch_tokens
    if cb.max_requests_per_batch is not None:
        changes["max_num_seqs"] = cb.max_requests_per_batch
    if cb.max_memory_percent is not None:
        changes["memory_fraction"] = cb.max_memory_percent
    if cb.seed is not None:
        changes["seed"] = cb.seed
    changes["enable_prefix_caching"] = bool(cb.allow_block_sharing)
    if cb.scheduler_type not in SCHEDULERS:
        raise NotImplementedError(
            f"ContinuousBatchingConfig.scheduler_type={cb.scheduler_type!r} has no equivalent in the paged engine; "
            f"use one of {sorted(SCHEDULERS)}"
        )
    changes["scheduling_policy"] = SCHEDULERS[cb.scheduler_type]
    graphs = cb.use_cuda_graph
    if isinstance(graphs, tuple):  # (varlen path, decode path): our graphs replay decode steps only
        graphs = graphs[1]
    if graphs is not None:
        changes["cuda_graphs"] = bool(graphs)
    return base.replace(**changes), CBOptions(bool(cb.return_logprobs), bool(cb.per_request_processors))
