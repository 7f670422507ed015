"""Step builder: the one place where a step's tensors are made, once per step, never per layer.

A step packs every scheduled request's new tokens along one axis (batch size 1 for the model).
The metadata built here travels to the attention function as the ``paged_metadata`` forward kwarg
and to ``PagedAttentionCache.update`` through the cache; nothing downstream recomputes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from ..core.layers import LayerKinds
from ..core.scheduler import ScheduledRequest


@dataclass(slots=True)
class GroupTables:
    """One attention group's part of a step: what differs between groups of a hybrid model."""

    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32, -1 for unallocated or released
    slot_mapping: torch.Tensor  # [N] int64
    gather_slots: torch.Tensor | None  # [K] int64, varlen path of a backend that gathers; else None
    cu_seq_lens_k: torch.Tensor  # [B + 1] int32
    max_length_k: int


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
    gather_slots: torch.Tensor | None  # [K] int64 slots of every key, packed: varlen path of a backend that gathers
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32, -1 for unallocated
    cache_seqlens: torch.Tensor  # [B] int32, tokens cached before this step
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the packed batch that are sampled
    is_decode: bool  # every request feeds exactly one token: the paged decode kernel runs
    backend: ModuleType | None = None
    # The cache.PagedLayer that PagedAttentionCache.update wrote last: the attention call that
    # follows attends over its pages (set by the cache during the forward).
    last_layer: Any = None
    # This step's metadata per device, shared by every copy (see ``on``)
    copies: dict[torch.device, StepMetadata] = field(default_factory=dict, repr=False)
    # Attention groups 1, 2, ... of a hybrid model (layers.py): their own tables (see ``for_group``)
    other_groups: list[GroupTables] = field(default_factory=list, repr=False)
    group_views: dict[int, StepMetadata] = field(default_factory=dict, repr=False)
    # Layer-independent work a kernel backend keeps for the step (torch backend: gather plans and
    # buffers); one per group view and device copy, since their tables differ
    memo: dict = field(default_factory=dict, repr=False)

    def for_group(self, group: int) -> StepMetadata:
        """This step as the layers of attention ``group`` see it: their block tables, cache slots
        and key lengths (group 0's are this object's own); made once per step and group."""
        if group == 0:
            return self
        view = self.group_views.get(group)
        if view is None:
            tables = self.other_groups[group - 1]
            view = dataclasses.replace(
                self, **_shallow(tables), other_groups=[], group_views={}, copies={}, memo={}
            )
            self.group_views[group] = view
        return view

    def on(self, device: torch.device) -> StepMetadata:
        """This metadata with its tensors on ``device``, moved at most once per step and device: the
        layers of a model that accelerate spreads over devices each read it where they run. Not
        named ``to``: accelerate's hooks would call that on every hooked module."""
        if self.input_ids.device == device:
            return self
        self.copies.setdefault(self.input_ids.device, self)  # so that a copy finds its way back
        copy = self.copies.get(device)
        if copy is None:  # tiny tensors; a blocking copy keeps device-to-host moves safe
            moved = {
                f.name: value.to(device)
                for f in dataclasses.fields(self)
                if isinstance(value := getattr(self, f.name), torch.Tensor)
            }
            copy = dataclasses.replace(self, **moved, group_views={}, memo={})  # shares ``copies``
            self.copies[device] = copy
        return copy


def _shallow(tables: GroupTables) -> dict:
    """``tables``' fields by name, the tensors themselves (``dataclasses.asdict`` would copy them)."""
    return {f.name: getattr(tables, f.name) for f in dataclasses.fields(tables)}


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
    layers: LayerKinds | None = None,
    sampled: list[bool] | None = None,
    backend: ModuleType | None = None,
) -> StepMetadata:
    """Tensors of one step. ``sampled[i]`` says whether request i's last new token is sampled
    (default: when its chunk reaches the end of its known tokens). Each attention group gets its
    own tables (``layers.groups``; one group unless the model mixes sliding and full layers).
    ``backend``: the kernel backend the step runs on; the slots of every key to gather on the
    varlen path are made only for one that does not read the pages itself (``PREFILL_FROM_PAGES``)."""
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [s.request.num_computed_tokens for s in scheduled]
    if sampled is None:
        sampled = [start + n == s.request.num_tokens for s, start, n in zip(scheduled, starts, q_lens)]
    token_ids: list[int] = []
    for s, start, n in zip(scheduled, starts, q_lens):
        token_ids.extend(s.request.token_slice(start, n))

    is_decode = max(q_lens) == 1
    if is_decode:  # one token per request, most steps: nothing to expand per token
        rows_q = torch.arange(len(scheduled))  # [N] = [B]
        cu_q = torch.arange(len(scheduled) + 1, dtype=torch.int32)
        positions = torch.tensor(starts)
    else:
        rows_q = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(q_lens))  # [N]
        cu_q = cumulative(q_lens, torch.device("cpu"))
        # position of every new token inside its own request
        positions = torch.arange(len(token_ids)) - cu_q[:-1].long()[rows_q] + torch.tensor(starts)[rows_q]
    windows = [g.window for g in layers.groups] if layers is not None and layers.groups else [None]
    gather = not is_decode and not getattr(backend, "PREFILL_FROM_PAGES", False)
    groups = [
        _group_tables(scheduled, g, window, starts, q_lens, rows_q, positions, block_size, device, gather)
        for g, window in enumerate(windows)
    ]
    if all(sampled):
        logits_indices = cu_q[1:].long() - 1
    else:
        logits_indices = (cu_q[1:].long() - 1)[torch.tensor(sampled, dtype=torch.bool)]
    return StepMetadata(
        input_ids=torch.tensor([token_ids], device=device),
        position_ids=positions.unsqueeze(0).to(device),
        cu_seq_lens_q=cu_q.to(device),
        max_length_q=max(q_lens),
        **_shallow(groups[0]),
        cache_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
        logits_indices=logits_indices.to(device),
        is_decode=is_decode,
        backend=backend,
        other_groups=groups[1:],
    )


def _group_tables(
    scheduled: list[ScheduledRequest],
    group: int,
    window: int | None,
    starts: list[int],
    q_lens: list[int],
    rows_q: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    device: torch.device,
    gather: bool,
) -> GroupTables:
    """One group's tables. A sliding group's varlen keys start at the first one the request's
    first query can see (older blocks may already be freed); the causal mask is bottom-right
    aligned, so dropping invisible leading keys changes nothing."""
    tables = [s.request.block_tables[group] for s in scheduled]
    width = max(map(len, tables))
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)  # [B, width]
    key_starts = [max(start - window + 1, 0) if window else 0 for start in starts]
    k_lens = [start + n - first for start, n, first in zip(starts, q_lens, key_starts)]
    gather_slots = None
    if gather:  # the slots of every key, packed, for a backend whose varlen path gathers
        rows_k = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(k_lens))  # [K]
        cu_k_cpu = cumulative(k_lens, torch.device("cpu"))
        key_pos = torch.arange(int(cu_k_cpu[-1])) - cu_k_cpu[:-1].long()[rows_k] + torch.tensor(key_starts)[rows_k]
        gather_slots = slots_of(table, rows_k, key_pos, block_size).to(device)
    return GroupTables(
        block_table=table.to(device),
        slot_mapping=slots_of(table, rows_q, positions, block_size).to(device),
        gather_slots=gather_slots,
        cu_seq_lens_k=cumulative(k_lens, device),
        max_length_k=max(k_lens),
    )
