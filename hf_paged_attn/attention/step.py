"""The step description: what one engine step feeds the model, built once per step, never per layer.

A step packs every scheduled request's new tokens along one axis (batch size 1 for the model).
``StepMetadata`` is a plain, frozen record of tensors and numbers: the executor runs the model on
it, the tensor-parallel driver sends it whole to the other ranks, a CUDA graph copies it into its
buffers. What a forward computes for itself while it runs (per-device copies, per-group views, the
kernels' plans) lives apart, in ``forward.ForwardContext``, so nothing here is ever cleared,
excluded from a broadcast or shared between forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.layers import LayerKinds
from ..core.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class GroupTables:
    """One attention group's part of a step: what differs between the groups of a hybrid model."""

    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32, -1 for unallocated or released
    slot_mapping: torch.Tensor  # [N] int64, flat cache slot of every new token
    cu_seq_lens_k: torch.Tensor  # [B + 1] int32, keys each request's queries see (a window cuts the oldest)
    max_length_k: int


@dataclass(frozen=True, slots=True, eq=False)
class StepMetadata:
    """Everything the model's forward, the cache and the attention function read for one step.

    Shapes use N = number of packed new tokens, B = number of requests. ``groups[0]`` is attention
    group 0's tables (every model has it); hybrid models (``core/layers.py``) have more.
    """

    input_ids: torch.Tensor  # [1, N] int64
    position_ids: torch.Tensor  # [1, N] int64, per-request positions ([3, 1, N] for M-RoPE requests with images)
    cu_seq_lens_q: torch.Tensor  # [B + 1] int32
    max_length_q: int
    cache_seqlens: torch.Tensor  # [B] int32, tokens cached before this step
    seqused_k: torch.Tensor  # [B] int32, cached + new tokens: the keys request b attends from its first
    logits_indices: torch.Tensor  # [num_sampled (+ prompt rows)] int64, rows of the packed batch whose logits are kept
    is_decode: bool  # every request feeds exactly one token: the paged decode kernel runs
    groups: tuple[GroupTables, ...]
    block_copies: tuple[tuple[int, int], ...] = ()  # copy on write before the forward: (src, dst) blocks
    has_beams: bool = False  # a beam search's beams are among the requests
    # the LoRA adapter of each request (None: the base model); () when every request runs the base model
    adapters: tuple[str | None, ...] = ()
    # [1, N, hidden]: the model's input instead of input_ids when a chunk feeds image tokens (runtime/multimodal.py)
    inputs_embeds: torch.Tensor | None = None

    @property
    def is_multimodal(self) -> bool:
        """Image features or 3-D positions in the step: it runs eagerly (graphs are of ids and 1-D positions)."""
        return self.inputs_embeds is not None or self.position_ids.dim() != 2

    # group 0's tables under the names of the spec (cu_seq_lens_k, max_length_k, block_table, ...)
    @property
    def block_table(self) -> torch.Tensor:
        return self.groups[0].block_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.groups[0].slot_mapping

    @property
    def cu_seq_lens_k(self) -> torch.Tensor:
        return self.groups[0].cu_seq_lens_k

    @property
    def max_length_k(self) -> int:
        return self.groups[0].max_length_k

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def ints(values: Sequence[int] | Sequence[bool], dtype: type = np.int64) -> torch.Tensor:
    """A 1-d tensor of Python numbers, made through numpy: ~2 us for a step's 64 ints, where ``torch.tensor``
    of a list takes 10-17 us (and 310 us for a [62, 48] block table against ~50-100 through numpy), a cost
    every step pays several times on the engine's one thread. Under inference mode it is an inference tensor,
    as ``torch.tensor``'s would be."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32, the layout flash-attn's cu_seqlens use."""
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return torch.from_numpy(out).to(device)


def varlen_lengths(
    q_lens: list[int], k_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` of a packed batch."""
    return cumulative(q_lens, device), cumulative(k_lens, device), max(q_lens), max(k_lens)


def build_step(
    scheduled: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    layers: LayerKinds | None = None,
    sampled: list[bool] | None = None,
    block_copies: list[tuple[int, int]] | tuple[tuple[int, int], ...] = (),
    drafts: list[list[int]] | None = None,
    scored: Sequence[tuple[int, range]] = (),
) -> StepMetadata:
    """The description of one step. ``sampled[i]`` says whether request i's last new token is
    sampled (default: when its chunk reaches the end of its known tokens). Each attention group gets
    its own tables (``layers.groups``; one group unless the model mixes sliding and full layers).
    ``block_copies``: the scheduler's copy-on-write pairs, carried out before the forward.
    ``drafts[i]``: speculative tokens fed after request i's known ones (counted in its
    ``num_new_tokens``); its last ``1 + len(drafts[i])`` rows are all sampled, to verify them.
    ``scored``: the requests scoring prompt tokens and their positions (``prompt_scoring(scheduled)``,
    which the engine hands the update too); those positions' rows come last."""
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [s.request.num_computed_tokens for s in scheduled]
    known = q_lens if drafts is None else [n - len(d) for n, d in zip(q_lens, drafts)]
    if sampled is None:
        sampled = [start + n == s.request.num_tokens for s, start, n in zip(scheduled, starts, known)]
    token_ids: list[int] = []
    for i, (s, start, n) in enumerate(zip(scheduled, starts, known)):
        token_ids.extend(s.request.token_slice(start, n))
        if drafts is not None:
            token_ids.extend(drafts[i])

    # The index arithmetic in numpy: each torch op on a step's few ints costs 5-20 us of dispatch, numpy's ~1
    num = len(scheduled)
    start_of = np.array(starts, dtype=np.int64)  # [B]
    q_of = np.array(q_lens, dtype=np.int64)  # [B]
    is_decode = max(q_lens) == 1
    if is_decode:  # one token per request, most steps: nothing to expand per token
        rows_q = np.arange(num)  # [N] = [B]
        cu_q = np.arange(num + 1, dtype=np.int32)
        positions = start_of
    else:
        rows_q = np.repeat(np.arange(num), q_of)  # [N]: each new token's request
        cu_q = np.zeros(num + 1, dtype=np.int32)
        np.cumsum(q_of, out=cu_q[1:])
        # position of every new token inside its own request
        positions = np.arange(len(token_ids)) - cu_q[:-1][rows_q] + start_of[rows_q]
    windows = [g.window for g in layers.groups] if layers is not None and layers.groups else [None]
    groups = tuple(
        _group_tables(scheduled, g, window, starts, q_lens, rows_q, positions, block_size, device)
        for g, window in enumerate(windows)
    )
    last_rows = cu_q[1:].astype(np.int64) - 1  # [B]: each request's last row
    if drafts is not None and any(drafts):
        counts = [len(d) + 1 if d else int(f) for d, f in zip(drafts, sampled)]
        logits_indices = _verified_rows(torch.from_numpy(last_rows + 1), counts)
    elif all(sampled):
        logits_indices = torch.from_numpy(last_rows)
    else:
        logits_indices = torch.from_numpy(last_rows[np.array(sampled, dtype=np.bool_)])
    if scored:  # prompt_logprobs: the rows that score prompt tokens follow the sampled ones
        extra = [int(cu_q[i]) + p - starts[i] for i, positions in scored for p in positions]
        logits_indices = torch.cat([logits_indices, ints(extra)])
    return StepMetadata(
        input_ids=ints(token_ids).unsqueeze(0).to(device),  # [1, N]
        position_ids=torch.from_numpy(positions).unsqueeze(0).to(device),
        cu_seq_lens_q=torch.from_numpy(cu_q).to(device),
        max_length_q=max(q_lens),
        cache_seqlens=torch.from_numpy(start_of.astype(np.int32)).to(device),
        seqused_k=torch.from_numpy((start_of + q_of).astype(np.int32)).to(device),
        logits_indices=logits_indices.to(device),
        is_decode=is_decode,
        groups=groups,
        block_copies=tuple(block_copies),
        has_beams=any(s.request.group is not None for s in scheduled),
        adapters=tuple(s.request.adapter for s in scheduled) if any(s.request.adapter for s in scheduled) else (),
    )


def prompt_scoring(scheduled: list[ScheduledRequest]) -> list[tuple[int, range]]:
    """(index in ``scheduled``, positions) of the requests whose chunk scores prompt tokens
    (``Request.prompt_positions``): their logits rows come last in ``logits_indices``, in this order
    (``build_step(scored=)``, ``Sampler.sample(scored=)``). Read before the step's tokens are
    committed (``num_computed_tokens`` is the chunk's start)."""
    out = []
    for i, s in enumerate(scheduled):
        if s.request.scores_prompt:
            positions = s.request.prompt_positions(s.request.num_computed_tokens, s.num_new_tokens)
            if positions:
                out.append((i, positions))
    return out


def _verified_rows(ends: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The last ``counts[i]`` rows of request i, whose rows end at ``ends[i]`` [B]: [sum(counts)] int64."""
    num = ints(counts)
    first = torch.repeat_interleave(ends - num, num)  # [sum(counts)] each row's request's first sampled row
    offsets = torch.arange(int(num.sum())) - torch.repeat_interleave(num.cumsum(0) - num, num)
    return first + offsets


def _group_tables(
    scheduled: list[ScheduledRequest],
    group: int,
    window: int | None,
    starts: list[int],
    q_lens: list[int],
    rows_q: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    device: torch.device,
) -> GroupTables:
    """One group's tables. A sliding group's keys start at the first one the request's first query
    can see (older blocks may already be freed); the causal mask is bottom-right aligned, so
    dropping invisible leading keys changes nothing."""
    tables = [s.request.block_tables[group] for s in scheduled]
    padded = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)  # [B, width], -1 past each table
    for row, blocks in enumerate(tables):
        padded[row, : len(blocks)] = blocks
    # [N]: the flat cache slot of each new token (request ``rows_q[i]``'s token at ``positions[i]``)
    slots = padded[rows_q, positions // block_size].astype(np.int64) * block_size + positions % block_size
    key_starts = [max(start - window + 1, 0) if window else 0 for start in starts]
    k_lens = [start + n - first for start, n, first in zip(starts, q_lens, key_starts)]
    return GroupTables(
        block_table=torch.from_numpy(padded).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        cu_seq_lens_k=cumulative(k_lens, device),
        max_length_k=max(k_lens),
    )
