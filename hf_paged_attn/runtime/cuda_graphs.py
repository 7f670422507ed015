"""CUDA graphs of decode steps: the GPU replays a step's kernels without waiting for Python.

A decode step (every request feeds one token) launches the same kernels every time; only the data
changes. ``DecodeGraphs`` captures the model's forward once per batch-size *bucket* (1, 2, 4, 8, 16,
24, ... up to ``max_num_seqs``), lazily, the first time a step of that size comes, over *static*
buffers: input ids, positions, cache lengths, each attention group's block table (one fixed width,
the most blocks a request can hold), slot mapping and key offsets. Each step copies its metadata
into the first rows of those buffers and replays the bucket's graph; the logits of its real rows
come back. Everything else runs eagerly as before: steps with prefill, beam search, more requests
than the largest bucket, tables wider than the buffers, tensor-parallel engines, models spread
over several devices and models whose weights accelerate offloads.

A graph bakes in every Python-side value of the capture, so only backends whose decode kernel reads
lengths and tables from device tensors and whose launch parameters follow from shapes can be
captured (``Backend.graph_safe``: triton, flash; the torch backend plans on the host).

Padding rows (the bucket's rows past the step's requests) are harmless by construction: cache
length 0, a block table whose only block is a *scratch block* that no request ever holds (the cache
has one page more than the allocator hands out), slot mapping into that block. Their new K/V land
in the scratch block, their attention reads only it, and their logits are dropped.

The capture is injectable (``graph_factory``): ``CudaGraphFactory`` on a GPU; tests on the CPU use a
stand-in that re-runs the captured function on "replay", which reads nothing but the static buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..attention.step import GroupTables, StepMetadata
from ..core.blocks import blocks_for
from .placement import layer_devices

if TYPE_CHECKING:
    from ..core.scheduler import ScheduledRequest
    from .engine import ContinuousBatchingEngine

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy init, Triton compiles, cuBLAS)


class Graph(Protocol):
    def replay(self) -> None: ...


# capture(fn) -> (graph, out): ``graph.replay()`` recomputes ``out`` in place from the buffers fn read
GraphFactory = Callable[[Callable[[], torch.Tensor]], tuple[Graph, torch.Tensor]]


class CudaGraphFactory:
    """Captures with ``torch.cuda.graph``, every bucket into one shared memory pool: a graph's
    temporaries are free again once its capture ends, so the next capture reuses them, and only
    each bucket's output stays."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream, as PyTorch's docs ask: first calls allocate, compile and pick
        # algorithms, none of which a capture may do.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8, and ``max_num_seqs``."""
    sizes = {n for n in (1, 2, 4) if n < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return sorted(sizes)


def max_blocks_per_seq(max_positions: int | None, block_size: int, num_blocks: int) -> int:
    """The static block-table width: the blocks a request of ``max_positions`` tokens holds, never
    more than the cache has (a request wider than this runs eagerly)."""
    return min(blocks_for(max_positions, block_size), num_blocks) if max_positions else num_blocks


@dataclass(slots=True)
class _Buffers:
    """The static inputs every bucket's graph reads (bucket b reads the first b rows)."""

    input_ids: torch.Tensor  # [1, M] int64
    position_ids: torch.Tensor  # [1, M] int64
    cache_seqlens: torch.Tensor  # [M] int32
    cu_seq_lens_q: torch.Tensor  # [M + 1] int32, 0..M: one query per row
    logits_indices: torch.Tensor  # [M] int64, 0..M-1
    ramp: torch.Tensor  # [M + 1] int32, 0..M: key offsets of padding rows (one key each)
    tables: list[GroupTables]  # per attention group: block_table [M, W], slot_mapping [M], cu_seq_lens_k [M + 1]


@dataclass(slots=True)
class _Captured:
    meta: StepMetadata  # views of the buffers, what the graph's forward read
    graph: Graph
    logits: torch.Tensor  # [bucket, vocab], rewritten by every replay


class DecodeGraphs:
    """The decode-step runner of one engine: buckets, static buffers, capture and replay.

    ``num_captures`` / ``num_replays`` count graphs captured and steps replayed.
    """

    def __init__(
        self,
        engine: ContinuousBatchingEngine,
        graph_factory: GraphFactory | None = None,
        backend: object | None = None,
    ) -> None:
        self.engine = engine  # its model, its cache (made after this runner) and its layer kinds
        self.backend = backend or engine.backend
        self.graph_factory = graph_factory or CudaGraphFactory(engine.device)
        config = engine.config
        self.buckets = decode_buckets(config.max_num_seqs)
        self.block_size = config.block_size
        # The cache has one page more than the allocator: block ``num_blocks`` is nobody's.
        self.scratch_block = engine.allocator.num_blocks
        self.width = max_blocks_per_seq(engine.max_position_embeddings, self.block_size, engine.allocator.num_blocks)
        self.device = engine.device
        self.captured: dict[int, _Captured] = {}
        self.buffers: _Buffers | None = None
        self.failed: str | None = None  # why a capture failed: then every step runs eagerly
        self.num_captures = 0
        self.num_replays = 0

    @classmethod
    def for_engine(cls, engine: ContinuousBatchingEngine) -> DecodeGraphs | None:
        """The runner ``engine`` uses, or None when its steps all run eagerly: graphs off in its
        resolved config, a tensor-parallel model, layers on several devices or not on CUDA, or
        weights that accelerate offloads (its hooks copy them in at every forward, from the host)."""
        model = engine.model
        if not engine.config.cuda_graphs or engine.device.type != "cuda":
            return None
        if (getattr(model, "tp_size", None) or 1) > 1 or len(set(layer_devices(model))) > 1:
            return None
        if {"cpu", "disk"} & {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}:
            return None
        return cls(engine)

    # ----------------------------------------------------------------------------- per step
    def forward(self, meta: StepMetadata, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Logits of the step's sampled rows, [num_sampled, vocab] float32: replayed from the
        bucket's graph when the step can be, else from the engine's eager ``_forward``."""
        bucket = self.bucket_for(meta, scheduled)
        captured = None if bucket is None else self.captured.get(bucket) or self._capture(bucket)
        if captured is None:
            return self.engine._forward(meta)
        self._load(meta, bucket)
        captured.graph.replay()
        self.num_replays += 1
        return captured.logits[meta.logits_indices].float()  # a copy: the next replay overwrites

    def bucket_for(self, meta: StepMetadata, scheduled: Sequence[ScheduledRequest]) -> int | None:
        """The smallest bucket that holds this step, or None when it must run eagerly."""
        num_rows = meta.input_ids.shape[1]
        if not meta.is_decode or self.failed is not None or num_rows > self.buckets[-1]:
            return None
        if not self.engine.layers.observed:  # the first step shows each layer's window (engine._run)
            return None
        if any(s.request.group is not None for s in scheduled):  # beam search
            return None
        tables = [meta.block_table, *(g.block_table for g in meta.other_groups)]
        if any(t.shape[1] > self.width for t in tables):
            return None
        return next(b for b in self.buckets if b >= num_rows)

    def _load(self, meta: StepMetadata, bucket: int) -> None:
        """Copy the step into the buffers' first rows; the rest up to ``bucket`` become padding."""
        buf, n = self.buffers, meta.input_ids.shape[1]
        buf.input_ids[:, :n].copy_(meta.input_ids)
        buf.position_ids[:, :n].copy_(meta.position_ids)
        buf.cache_seqlens[:n].copy_(meta.cache_seqlens)
        for static, step in zip(buf.tables, [meta, *meta.other_groups], strict=True):
            width = step.block_table.shape[1]
            static.block_table[:n, :width].copy_(step.block_table)
            static.block_table[:n, width:] = -1
            static.slot_mapping[:n].copy_(step.slot_mapping)
            static.cu_seq_lens_k[: n + 1].copy_(step.cu_seq_lens_k)
            # padding rows hold one key each, after the real rows' keys
            keys = static.cu_seq_lens_k[n + 1 : bucket + 1]
            torch.add(buf.ramp[1 : bucket - n + 1], step.cu_seq_lens_k[-1], out=keys)
        self._pad(n, bucket)

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` become padding rows: no cached token, the scratch block as their
        only block (their new K/V land in its first slot). Their key offsets are set by the caller."""
        buf = self.buffers
        buf.input_ids[:, start:stop] = 0
        buf.position_ids[:, start:stop] = 0
        buf.cache_seqlens[start:stop] = 0
        for static in buf.tables:
            static.block_table[start:stop] = -1
            static.block_table[start:stop, 0] = self.scratch_block
            static.slot_mapping[start:stop] = self.scratch_block * self.block_size

    # ----------------------------------------------------------------------------- capture
    def _capture(self, bucket: int) -> _Captured | None:
        """Capture ``bucket``'s graph over all-padding buffers: its warm-up runs write only the
        scratch block. A failure turns graphs off for this engine (logged), steps run eagerly."""
        if self.buffers is None:
            self.buffers = self._make_buffers()
        self._pad(0, bucket)
        for static in self.buffers.tables:
            static.cu_seq_lens_k[: bucket + 1] = self.buffers.ramp[: bucket + 1]
        meta = self._static_meta(bucket)
        try:
            graph, logits = self.graph_factory(lambda: self._run_static(meta))
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("capturing the decode step of %d rows failed (%s); decode steps run eagerly", bucket, exc)
            return None
        self.captured[bucket] = captured = _Captured(meta, graph, logits)
        self.num_captures += 1
        return captured

    def _run_static(self, meta: StepMetadata) -> torch.Tensor:
        """The forward a graph holds: reads the static buffers only. [bucket, vocab] logits."""
        # Per-step work a backend keeps on the metadata must not outlive a run (a replay that
        # re-runs this function, as the CPU tests' stand-in does, must plan afresh).
        meta.memo.clear()
        meta.group_views.clear()
        cache = self.engine.cache
        with cache.step(meta):
            out = self.engine.model(input_ids=meta.input_ids, position_ids=meta.position_ids, cache=cache,
                                    use_cache=True, paged_metadata=meta, logits_to_keep=0)  # fmt: skip
        return out.logits[0]

    def _make_buffers(self) -> _Buffers:
        rows, width, device = self.buckets[-1], self.width, self.device
        ramp = torch.arange(rows + 1, dtype=torch.int32, device=device)

        def group_tables() -> GroupTables:
            return GroupTables(
                block_table=torch.full((rows, width), -1, dtype=torch.int32, device=device),
                slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
                gather_slots=None,
                cu_seq_lens_k=ramp.clone(),
                max_length_k=width * self.block_size,  # an upper bound: nothing on the decode path reads it
            )

        return _Buffers(
            input_ids=torch.zeros(1, rows, dtype=torch.int64, device=device),
            position_ids=torch.zeros(1, rows, dtype=torch.int64, device=device),
            cache_seqlens=torch.zeros(rows, dtype=torch.int32, device=device),
            cu_seq_lens_q=ramp.clone(),
            logits_indices=torch.arange(rows, device=device),
            ramp=ramp,
            tables=[group_tables() for _ in self.engine.layers.groups],
        )

    def _static_meta(self, bucket: int) -> StepMetadata:
        """Step metadata of ``bucket`` rows, every tensor a view of the buffers."""
        buf = self.buffers

        def rows(t: GroupTables) -> GroupTables:
            return GroupTables(t.block_table[:bucket], t.slot_mapping[:bucket], None, t.cu_seq_lens_k[: bucket + 1],
                               t.max_length_k)  # fmt: skip

        first, *others = [rows(t) for t in buf.tables]
        return StepMetadata(
            input_ids=buf.input_ids[:, :bucket],
            position_ids=buf.position_ids[:, :bucket],
            cu_seq_lens_q=buf.cu_seq_lens_q[: bucket + 1],
            cu_seq_lens_k=first.cu_seq_lens_k,
            max_length_q=1,
            max_length_k=first.max_length_k,
            slot_mapping=first.slot_mapping,
            gather_slots=None,
            block_table=first.block_table,
            cache_seqlens=buf.cache_seqlens[:bucket],
            logits_indices=buf.logits_indices[:bucket],
            is_decode=True,
            backend=self.backend,
            other_groups=others,
        )
