"""Batch building: the one place where a step's tensors are made.

A step packs every scheduled request's new tokens along one axis (batch size 1 for the model).
The metadata built here travels to the attention function as the ``paged_metadata`` forward kwarg
and to ``PagedAttentionCache.update`` through the cache; nothing downstream recomputes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from .scheduler import ScheduledRequest

if TYPE_CHECKING:
    from .cache import PagedAttentionCache


@dataclass(slots=True, eq=False)
class StepMetadata:
    """Everything the attention function and the cache need for one step.

    Shapes use N = number of packed new tokens, B = number of requests, K = sum of key lengths.
    """

    input_ids: torch.Tensor  # [1, N] int64
    position_ids: torch.Tensor  # [1, N] int64, per-request positions
    cu_seq_lens_q: torch.Tensor  # [B + 1] int32
    cu_seq_lens_k: torch.Tensor  # [B + 1] int32, keys = cached + new tokens
    max_length_q: int
    max_length_k: int
    slot_mapping: torch.Tensor  # [N] int64, flat cache slot of every new token
    gather_slots: torch.Tensor | None  # [K] int64, varlen path: slots of every key, packed
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32, -1 for unallocated
    cache_seqlens: torch.Tensor  # [B] int32, tokens cached before this step
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the packed batch that are sampled
    is_decode: bool  # every request feeds exactly one token: the paged decode kernel runs
    backend: ModuleType | None = None
    cache: PagedAttentionCache | None = None
    memo: dict = field(default_factory=dict)  # per-step, layer-independent work a kernel backend keeps


def cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32, the layout flash-attn's cu_seqlens use."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.to(device)


def varlen_lengths(
    q_lens: list[int], k_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` of a packed batch."""
    return cumulative(q_lens, device), cumulative(k_lens, device), max(q_lens), max(k_lens)


def slots_of(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slot of token ``positions[i]`` of request ``rows[i]`` (vectorised)."""
    blocks = block_table[rows, positions // block_size].long()
    return blocks * block_size + positions % block_size


def build_step(
    scheduled: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    sampled: list[bool] | None = None,
    window: int | None = None,
) -> StepMetadata:
    """Tensors of one step. ``sampled[i]`` says whether request i's last new token is sampled
    (default: when its chunk reaches the end of its known tokens). With a ``window`` shared by
    every layer, the varlen path gets each request's keys from the first one its first query can
    see (older blocks may already be freed); the causal mask is bottom-right aligned, so dropping
    invisible leading keys changes nothing."""
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [s.request.num_computed_tokens for s in scheduled]
    key_starts = [max(start - window + 1, 0) if window else 0 for start in starts]
    k_lens = [start + n - first for start, n, first in zip(starts, q_lens, key_starts)]
    if sampled is None:
        sampled = [start + n == s.request.num_tokens for s, start, n in zip(scheduled, starts, q_lens)]

    token_ids: list[int] = []
    for s, start, n in zip(scheduled, starts, q_lens):
        token_ids.extend(s.request.all_ids[start : start + n])

    max_blocks = max(len(s.request.block_ids) for s in scheduled)
    table = torch.full((len(scheduled), max_blocks), -1, dtype=torch.int32)
    for row, s in enumerate(scheduled):
        table[row, : len(s.request.block_ids)] = torch.tensor(s.request.block_ids, dtype=torch.int32)

    q_lens_t = torch.tensor(q_lens)
    rows_q = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens_t)  # [N]
    cu_q = cumulative(q_lens, torch.device("cpu"))
    # position of every new token inside its own request
    positions = torch.arange(len(token_ids)) - cu_q[:-1].long()[rows_q] + torch.tensor(starts)[rows_q]
    slot_mapping = slots_of(table, rows_q, positions, block_size)

    is_decode = max(q_lens) == 1
    gather_slots = None
    if not is_decode:
        k_lens_t = torch.tensor(k_lens)
        rows_k = torch.repeat_interleave(torch.arange(len(scheduled)), k_lens_t)  # [K]
        cu_k_cpu = cumulative(k_lens, torch.device("cpu"))
        key_pos = torch.arange(int(cu_k_cpu[-1])) - cu_k_cpu[:-1].long()[rows_k] + torch.tensor(key_starts)[rows_k]
        gather_slots = slots_of(table, rows_k, key_pos, block_size).to(device)

    logits_indices = (cu_q[1:].long() - 1)[torch.tensor(sampled, dtype=torch.bool)]
    cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k = varlen_lengths(q_lens, k_lens, device)
    return StepMetadata(
        input_ids=torch.tensor([token_ids], device=device),
        position_ids=positions.unsqueeze(0).to(device),
        cu_seq_lens_q=cu_seq_lens_q,
        cu_seq_lens_k=cu_seq_lens_k,
        max_length_q=max_length_q,
        max_length_k=max_length_k,
        slot_mapping=slot_mapping.to(device),
        gather_slots=gather_slots,
        block_table=table.to(device),
        cache_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
        logits_indices=logits_indices.to(device),
        is_decode=is_decode,
    )
