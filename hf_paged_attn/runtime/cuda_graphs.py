"""CUDA graphs of decode steps: the GPU replays a step's kernels without waiting for Python.

A decode step (every request feeds one token) launches the same kernels every time; only the data
changes. ``CudaGraphExecutor`` captures the model's forward once per batch-size *bucket* (1, 2, 4, 8, 16,
24, ... up to ``max_num_seqs``), lazily, the first time a step of that size comes, over *static*
buffers: input ids, positions, cache lengths, each attention group's block table (one fixed width,
the most blocks a request can hold), slot mapping and key offsets. Each step copies its metadata
into the first rows of those buffers and replays the bucket's graph; the logits of its real rows
come back. Everything else runs eagerly as before: steps with prefill, beam search, more requests
than the largest bucket and tables wider than the buffers (the executor is only chosen for a model on
one CUDA device whose weights accelerate does not offload: ``launcher.LocalLauncher``).

A graph bakes in every Python-side value of the capture, so only backends whose decode kernel reads
lengths and tables from device tensors and whose launch parameters follow from shapes can be
captured (``Backend.graph_safe``: triton, flash; the torch backend plans on the host).

Padding rows (the bucket's rows past the step's requests) are harmless by construction: cache
length 0, a block table whose only block is a *scratch block* that no request ever holds (the cache
has one page more than the allocator hands out), slot mapping into that block. Their new K/V land
in the scratch block, their attention reads only it, and their logits are dropped.

The capture is injectable (``graph_factory``): ``CudaGraphFactory`` on a GPU; tests on the CPU use
``hf_paged_attn_tools.testing.FrozenGraphs``, which replays the traced ops with the capture's host values
frozen, as a CUDA graph does, so a value that must come from the static buffers fails there if it does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..attention.step import GroupTables, StepMetadata
from ..core.blocks import blocks_for
from ..core.layers import LayerKinds
from .config import PagedConfig

if TYPE_CHECKING:
    from .executor import LocalExecutor

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
    seqused_k: torch.Tensor  # [M] int32, cache_seqlens + 1
    cu_seq_lens_q: torch.Tensor  # [M + 1] int32, 0..M: one query per row
    logits_indices: torch.Tensor  # [M] int64, 0..M-1
    ramp: torch.Tensor  # [M + 1] int32, 0..M: key offsets of padding rows (one key each)
    tables: list[GroupTables]  # per attention group: block_table [M, W], slot_mapping [M], cu_seq_lens_k [M + 1]


@dataclass(slots=True)
class _Captured:
    meta: StepMetadata  # views of the buffers, what the graph's forward read
    graph: Graph
    logits: torch.Tensor  # [bucket, vocab], rewritten by every replay


class CudaGraphExecutor:
    """Decode steps replayed from CUDA graphs (buckets, static buffers, capture and replay); every
    other step through ``eager``, whose cache and model the graphs capture.

    ``scratch_block``: a page of the cache that no request ever holds (padding rows write there).
    ``num_captures`` / ``num_replays`` count graphs captured and steps replayed.
    """

    def __init__(
        self,
        eager: LocalExecutor,
        layers: LayerKinds,
        config: PagedConfig,
        scratch_block: int,
        max_positions: int | None,
        graph_factory: GraphFactory | None = None,
    ) -> None:
        self.eager = eager
        self.layers = layers  # the layer kinds: graphs wait until the first step has confirmed the windows
        self.device: torch.device | None = None  # the steps' device, known at the first capture
        self.graph_factory = graph_factory
        self.buckets = decode_buckets(config.max_num_seqs)
        self.block_size = config.block_size
        self.scratch_block = scratch_block
        self.width = max_blocks_per_seq(max_positions, self.block_size, scratch_block)
        self.captured: dict[int, _Captured] = {}
        self.buffers: _Buffers | None = None
        self.failed: str | None = None  # why a capture failed: then every step runs eagerly
        self.num_captures = 0
        self.num_replays = 0

    # ----------------------------------------------------------------------------- per step
    def execute(self, step: StepMetadata) -> torch.Tensor:
        """Logits of the step's sampled rows, [num_sampled, vocab] float32: replayed from the
        bucket's graph when the step can be, else from the eager executor."""
        bucket = self.bucket_for(step)
        captured = None if bucket is None else self.captured.get(bucket) or self._capture(bucket, step)
        if captured is None:
            return self.eager.execute(step)
        self.eager.prepare(step)
        self._load(step, bucket)
        captured.graph.replay()
        self.num_replays += 1
        return captured.logits[step.logits_indices].float()  # a copy: the next replay overwrites

    def bucket_for(self, step: StepMetadata) -> int | None:
        """The smallest bucket that holds this step, or None when it must run eagerly."""
        num_rows = step.num_tokens
        if not step.is_decode or self.failed is not None or num_rows > self.buckets[-1]:
            return None
        if not self.layers.observed:  # the first step shows each layer's window (engine.step)
            return None
        if step.has_beams or step.is_multimodal:  # beam search and image steps run eagerly
            return None
        if any(g.block_table.shape[1] > self.width for g in step.groups):
            return None
        return next(b for b in self.buckets if b >= num_rows)

    def close(self) -> None:
        self.captured.clear()

    def _load(self, meta: StepMetadata, bucket: int) -> None:
        """Copy the step into the buffers' first rows; the rest up to ``bucket`` become padding."""
        buf, n = self.buffers, meta.input_ids.shape[1]
        buf.input_ids[:, :n].copy_(meta.input_ids)
        buf.position_ids[:, :n].copy_(meta.position_ids)
        buf.cache_seqlens[:n].copy_(meta.cache_seqlens)
        buf.seqused_k[:n].copy_(meta.seqused_k)
        for static, step in zip(buf.tables, meta.groups, strict=True):
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
        buf.seqused_k[start:stop] = 1
        for static in buf.tables:
            static.block_table[start:stop] = -1
            static.block_table[start:stop, 0] = self.scratch_block
            static.slot_mapping[start:stop] = self.scratch_block * self.block_size

    # ----------------------------------------------------------------------------- capture
    def _capture(self, bucket: int, step: StepMetadata) -> _Captured | None:
        """Capture ``bucket``'s graph over all-padding buffers: its warm-up runs write only the
        scratch block. A failure turns graphs off for this executor (logged), steps run eagerly."""
        if self.buffers is None:
            self.device = step.input_ids.device
            self.buffers = self._make_buffers()
        if self.graph_factory is None:
            self.graph_factory = CudaGraphFactory(self.device)
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
        """The forward a graph holds: reads the static buffers only. [bucket, vocab] logits. What the
        kernels are given as host values (lengths, bounds) is frozen at capture: they must hold for every
        step the bucket replays."""
        return self.eager.logits(meta, 0)

    def _make_buffers(self) -> _Buffers:
        rows, width, device = self.buckets[-1], self.width, self.device
        ramp = torch.arange(rows + 1, dtype=torch.int32, device=device)

        def group_tables() -> GroupTables:
            return GroupTables(
                block_table=torch.full((rows, width), -1, dtype=torch.int32, device=device),
                slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
                cu_seq_lens_k=ramp.clone(),
                max_length_k=width * self.block_size,  # an upper bound: nothing on the decode path reads it
            )

        return _Buffers(
            input_ids=torch.zeros(1, rows, dtype=torch.int64, device=device),
            position_ids=torch.zeros(1, rows, dtype=torch.int64, device=device),
            cache_seqlens=torch.zeros(rows, dtype=torch.int32, device=device),
            seqused_k=torch.ones(rows, dtype=torch.int32, device=device),
            cu_seq_lens_q=ramp.clone(),
            logits_indices=torch.arange(rows, device=device),
            ramp=ramp,
            tables=[group_tables() for _ in self.layers.groups],
        )

    def _static_meta(self, bucket: int) -> StepMetadata:
        """Step metadata of ``bucket`` rows, every tensor a view of the buffers."""
        buf = self.buffers

        def rows(t: GroupTables) -> GroupTables:
            return GroupTables(t.block_table[:bucket], t.slot_mapping[:bucket], t.cu_seq_lens_k[: bucket + 1],
                               t.max_length_k)  # fmt: skip

        return StepMetadata(
            input_ids=buf.input_ids[:, :bucket],
            position_ids=buf.position_ids[:, :bucket],
            cu_seq_lens_q=buf.cu_seq_lens_q[: bucket + 1],
            max_length_q=1,
            cache_seqlens=buf.cache_seqlens[:bucket],
            seqused_k=buf.seqused_k[:bucket],
            logits_indices=buf.logits_indices[:bucket],
            is_decode=True,
            groups=tuple(rows(t) for t in buf.tables),
        )
