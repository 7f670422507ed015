"""The torch backend's decode path (one query token per request) over a paged cache.

On CPU it first tries the native kernel (``cpu_native``, ``kernels/cpu_attention.c``), which reads the
pages in place; what follows is the torch-ops path it falls back to (no C compiler, float16)
and the path on CUDA:

* requests are cut into at most three buckets of similar length; each bucket's pages are gathered
  into [bucket, its max_len, H_kv, D] in one indexing op, a length/window mask hides the tail, and
  one batched attention call does the rest. The query heads that share a kv head are folded into
  the query axis ([B, H_kv, group, D]), which runs 2-3x faster than SDPA's ``enable_gqa`` for a
  single query token. Everything that depends only on the block table and lengths (append slots,
  buckets, gather indices, masks, cascade groups) is computed by the first layer of a forward and
  kept in its ``memo`` for the others, and on CPU the gathers go into one reused workspace: a fresh
  multi-MiB tensor per layer was page-faulted (zero-filled) by the kernel on every call.
* shared prefixes (cascade): requests whose leading blocks are the same physical blocks (prefix
  caching, ``num_return_sequences`` forks) gather those blocks once per group and attend to them
  with one matmul; each request then gathers only the blocks after the shared ones, and the two
  partial softmaxes are merged through their log-sum-exps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import cpu_native
from ..base import AttentionOptions
from ..kv_dtype import to_pages, writable, write_pages
from .dense import explicit_attention, key_visibility
from .prefill import paged_prefill_attention


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


CASCADE_MIN_TOKENS = 32  # shared tokens below which a group is not worth its own matmul
WORKSPACE_HEADROOM = 1.25  # a decode step's gather grows by a token per request: grow buffers ahead of it
# Fixed cost of one more length bucket in the plain decode path (indexing, two gathers, one SDPA call,
# the scatter of its rows), in bytes of K/V it would take to gather and attend to in that time
# (~100 us at ~5 GB/s on the 2-core CPU of docs/performance.md).
BUCKET_OVERHEAD_BYTES = 1 << 19
MAX_BUCKETS = 3


@dataclass(slots=True)
class _PlainPlan:
    """Layer-independent tensors of one length bucket of the plain decode path (one gather of its
    requests' pages, padded to its longest request)."""

    rows: torch.Tensor | None  # [B_bucket] the bucket's rows of the batch; None: every row, in order
    pages: torch.Tensor | None  # [B * n_blocks] int64 block ids, -1 clamped to 0 (masked); None: no keys at all
    length: int  # L = n_blocks * block_size, keys per request after the gather
    mask: torch.Tensor | None  # bool [B, 1, 1, L]: which gathered keys each request sees
    blank: torch.Tensor | None  # bool [B, 1, 1, 1]: requests that see no key (output zeros); None if none


@dataclass(slots=True)
class _CascadePlan:
    """Layer-independent tensors of the cascade path (see ``_decode_cascade``)."""

    alone: torch.Tensor | None  # [B_alone] rows in no group, attended by the plain path
    alone_plan: list[_PlainPlan] | None
    rows: torch.Tensor  # [G] rows that share, group after group
    pages: torch.Tensor  # [G * width] each grouped row's blocks after its group's shared ones
    length: int  # width * block_size
    visible: torch.Tensor  # bool [G, 1, 1, length]
    groups: list[tuple[slice, torch.Tensor]]  # (span of ``rows``, the group's shared block ids)


@dataclass(slots=True)
class _DecodePlan:
    """Everything a decode step computes once for all its layers (``memo``): lengths, append slots, gather
    indices, masks and the cascade grouping depend on the block table and lengths only, never on the layer."""

    lens: torch.Tensor  # [B] int64 tokens attended per request (the appended one included)
    slots: torch.Tensor | None  # [B] int64 flat cache slot of each appended token
    plain: list[_PlainPlan] | None  # length buckets
    cascade: _CascadePlan | None


def _length_buckets(num_blocks: list[int], overhead: float) -> list[list[int]] | None:
    """Rows grouped into at most ``MAX_BUCKETS`` buckets of similar length, or None for one bucket.

    Each bucket gathers and attends ``rows x its longest row`` blocks, so one bucket pads every request to
    the batch's longest (about half the work is padding when lengths are spread evenly). Rows sorted by
    length are cut where ``sum(rows * longest) + overhead * buckets`` (in blocks) is smallest.
    """
    b = len(num_blocks)
    if b < 2:
        return None
    order = sorted(range(b), key=num_blocks.__getitem__)
    s = torch.tensor([num_blocks[r] for r in order], dtype=torch.float64)  # [B] ascending
    top = float(s[-1])
    cut = torch.arange(1, b, dtype=torch.float64)  # [B - 1] first row of the last bucket
    best, cuts = b * top, []
    two = cut * s[:-1] + (b - cut) * top  # [B - 1] cost with a cut before row i
    i = int(two.argmin())
    if float(two[i]) + overhead < best:
        best, cuts = float(two[i]) + overhead, [i + 1]
    if MAX_BUCKETS >= 3 and b >= 3:
        first, second = cut.view(-1, 1), cut.view(1, -1)  # [B - 1, 1], [1, B - 1]: cuts i < j
        three = first * s[:-1].view(-1, 1) + (second - first) * s[:-1].view(1, -1) + (b - second) * top
        three = three.masked_fill(first >= second, float("inf"))  # [B - 1, B - 1]
        flat = int(three.argmin())
        if float(three.view(-1)[flat]) + 2 * overhead < best:
            cuts = [flat // (b - 1) + 1, flat % (b - 1) + 1]
    if not cuts:
        return None
    bounds = [0, *cuts, b]
    return [order[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _plain_plan(
    lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    causal: bool,
    window: tuple[int, int],
    block_bytes: int,
) -> list[_PlainPlan]:
    """The plain path's buckets. ``block_bytes``: K and V bytes of one block, to weigh a bucket's overhead."""
    lens_list = lens.tolist()
    groups = _length_buckets([blocks_for(n, block_size) for n in lens_list], BUCKET_OVERHEAD_BYTES / block_bytes)
    if groups is None:
        return [_bucket_plan(None, lens, block_table, block_size, causal, window)]
    plans = []
    for rows in groups:
        idx = torch.tensor(rows, device=lens.device)
        plans.append(_bucket_plan(idx, lens[idx], block_table[idx], block_size, causal, window))
    return plans


def _bucket_plan(
    rows: torch.Tensor | None,
    lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    causal: bool,
    window: tuple[int, int],
) -> _PlainPlan:
    max_len = int(lens.max()) if lens.numel() else 0
    if max_len == 0:
        return _PlainPlan(rows, None, 0, None, None)
    pages = block_table[:, : blocks_for(max_len, block_size)].long().clamp_min(0)  # [B, n_blocks]; -1 masked below
    length = pages.shape[1] * block_size
    k_len = lens.view(-1, 1, 1)  # [B, 1, 1]
    k_pos = torch.arange(length, device=lens.device)  # [L]
    mask = key_visibility(k_len - 1, k_pos, k_len, causal, tuple(window)).unsqueeze(1)  # [B, 1, 1, L]
    blank = ~mask.any(dim=-1, keepdim=True)  # [B, 1, 1, 1]
    return _PlainPlan(rows, pages.flatten(), length, mask, blank if bool(blank.any()) else None)


def _cascade_plan(
    lens: torch.Tensor,
    block_table: torch.Tensor,
    groups: list[tuple[list[int], int]],
    block_size: int,
    causal: bool,
    window: tuple[int, int],
    block_bytes: int,
) -> _CascadePlan:
    device = lens.device
    grouped = [r for rows, _ in groups for r in rows]
    alone = sorted(set(range(lens.shape[0])) - set(grouped))
    alone_idx = torch.tensor(alone, device=device) if alone else None
    alone_plan = None
    if alone:
        alone_plan = _plain_plan(lens[alone_idx], block_table[alone_idx], block_size, causal, window, block_bytes)
    rows = torch.tensor(grouped, device=device)  # [G]
    n = len(grouped)
    skip = torch.tensor([shared for members, shared in groups for _ in members], device=device).view(n, 1)  # [G, 1]
    rest = lens[rows].view(n, 1) - skip * block_size  # [G, 1] tokens after the shared blocks (>= 0)
    width = max(blocks_for(int(rest.max()), block_size), 1)
    cols = (skip + torch.arange(width, device=device)).clamp_max(block_table.shape[1] - 1)  # [G, width]
    pages = block_table[rows].long().gather(1, cols).clamp_min(0).flatten()  # [G * width]; masked below
    visible = (torch.arange(width * block_size, device=device) < rest).view(n, 1, 1, -1)  # [G, 1, 1, L]
    spans, start = [], 0
    for members, shared in groups:
        spans.append((slice(start, start + len(members)), block_table[members[0], :shared].long()))
        start += len(members)
    return _CascadePlan(alone_idx, alone_plan, rows, pages, width * block_size, visible, spans)


def _decode_plan(
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    appended: bool,
    causal: bool,
    window: tuple[int, int],
    block_bytes: int,
) -> _DecodePlan:
    lens = cache_seqlens.long()  # [B]
    slots = None
    if appended:
        blocks = block_table.gather(1, (lens // block_size).view(-1, 1)).view(-1).long()  # [B]; must be allocated
        slots = blocks * block_size + lens % block_size  # [B]
        lens = lens + 1
    max_len = int(lens.max()) if lens.numel() else 0
    if max_len >= CASCADE_MIN_TOKENS and window[0] < 0:  # a window would cut into shared blocks
        groups = _shared_prefixes(block_table, lens.tolist(), block_size)
        if groups:
            cascade = _cascade_plan(lens, block_table, groups, block_size, causal, window, block_bytes)
            return _DecodePlan(lens, slots, None, cascade)
    return _DecodePlan(lens, slots, _plain_plan(lens, block_table, block_size, causal, window, block_bytes), None)


def _workspace(memo: dict | None, k_cache: torch.Tensor) -> dict | None:
    """Reusable gather buffers on CPU, or None. A fresh multi-MiB tensor per layer is mmap'd and
    page-faulted (zero-filled by the kernel) on every call with glibc's malloc, which made the decode
    attention of the bundled model ~5x slower than its arithmetic. The forward's memo shares one
    workspace among the layers, and every layer's ``k_cache`` keeps a reference to it, so it lives
    exactly as long as the cache and the next step finds it again."""
    if memo is None or k_cache.device.type != "cpu":
        return None  # CUDA's caching allocator already reuses memory
    workspace = memo.get("workspace")
    if workspace is None:
        workspace = getattr(k_cache, "_hf_paged_workspace", None)
        memo["workspace"] = workspace = {} if workspace is None else workspace
    if getattr(k_cache, "_hf_paged_workspace", None) is not workspace:
        k_cache._hf_paged_workspace = workspace
    return workspace


def _gather(cache: torch.Tensor, pages: torch.Tensor, workspace: dict | None, name: str) -> torch.Tensor:
    """``cache.index_select(0, pages)`` -> [len(pages), block_size, H_kv, D], into a workspace buffer if given."""
    if workspace is None:
        return cache.index_select(0, pages)  # whole pages (memcpy); advanced indexing is ~5-20x slower on CPU
    shape = (pages.numel(), *cache.shape[1:])
    numel = math.prod(shape)
    key = (name, cache.dtype)
    buffer = workspace.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = workspace[key] = torch.empty(int(numel * WORKSPACE_HEADROOM), dtype=cache.dtype, device=cache.device)
    return torch.index_select(cache, 0, pages, out=buffer[:numel].view(shape))


def _append(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write the new token of each request in place at its flat slot [B]. caches [num_blocks, block_size,
    H_kv, D]; k, v [B, 1, H_kv, D]."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        rounded = to_pages(new[:, 0], cache.dtype)  # [B, H_kv, D]; fp8 pages: their uint8 bytes
        if cache.is_contiguous():
            writable(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, rounded)
        else:
            block_size = cache.shape[1]
            writable(cache)[slots // block_size, slots % block_size] = rounded


def _shared_prefixes(block_table: torch.Tensor, lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Groups of at least two requests whose first blocks are the same physical blocks.

    Returns (rows, shared) pairs: rows of ``block_table`` and how many leading blocks they share,
    counting only blocks that every row fills entirely (so each row sees all of their tokens). A
    block id names its content, so equal ids mean equal keys and values. A row is in one group at
    most. Rows are bucketed by their first ``CASCADE_MIN_TOKENS`` worth of blocks (fewer shared
    blocks never make a group, so a chat template's common first block does not tie unrelated
    requests together); inside a bucket the first row leads: the rows sharing its blocks to the
    depth that saves the most gathered blocks form a group, and the rest of the bucket goes again.
    """
    least = blocks_for(CASCADE_MIN_TOKENS, block_size)  # blocks a group must share
    if block_table.shape[1] < least:
        return []
    firsts = block_table[:, 0].tolist()
    if len(set(firsts)) == len(firsts):  # the common case without prefix sharing: nothing to group
        return []
    full = [n // block_size for n in lens]  # blocks each row fills
    buckets: dict[tuple[int, ...], list[int]] = {}
    for row, head in enumerate(block_table[:, :least].tolist()):
        if full[row] >= least and min(head) >= 0:  # -1: unallocated or released
            buckets.setdefault(tuple(head), []).append(row)
    out = []
    for rows in buckets.values():
        while len(rows) >= 2:
            width = max(full[r] for r in rows)
            sub = block_table[rows, :width]  # [n, width]
            filled = torch.arange(width).view(1, -1) < torch.tensor([full[r] for r in rows]).view(-1, 1)
            # Leading blocks each row shares with the leader and fills itself (the leader may not).
            match = ((sub == sub[:1]).cpu() & filled).int().cumprod(dim=1).sum(dim=1).tolist()  # [n]
            # Depth d shared by the c rows matching >= d saves (c - 1) * d gathered blocks: keep the best.
            ranked = sorted(match, reverse=True)
            depth = max(range(1, len(ranked)), key=lambda k: k * ranked[k])
            shared = ranked[depth]  # >= least: every row of the bucket shares its first `least` blocks
            out.append(([r for r, m in zip(rows, match, strict=True) if m >= shared], shared))
            rows = [r for r, m in zip(rows, match, strict=True) if m < shared]
    return out


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float, softcap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one part of the keys, normalised within it. q [..., M, D] fp32; k, v [..., L, D];
    visible bool broadcastable to [..., M, L] -> (out [..., M, D] fp32, lse [..., M] with -inf where no key)."""
    scores = (q @ k.transpose(-1, -2)).mul_(scale)  # [..., M, L]
    if softcap > 0:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if visible is not None:
        scores = scores.masked_fill_(~visible, float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [..., M]
    probs = (scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min)).exp_()  # 0 where masked
    return probs @ v, lse


def _decode_cascade(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _CascadePlan,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    workspace: dict | None,
) -> torch.Tensor:
    """Decode attention of grouped requests as (their group's shared blocks) + (their own blocks),
    merged by log-sum-exp; requests in no group take the plain path.

    q [B, 1, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]. Returns [B, 1, H, D] in q.dtype.
    """
    b, _, h, d = q.shape
    hk = k_cache.shape[2]
    out = torch.empty_like(q)  # [B, 1, H, D]
    if plan.alone is not None:  # SDPA on their own: the explicit path below is ~3x slower per key
        out[plan.alone] = _decode_plain(
            q[plan.alone], k_cache, v_cache, plan.alone_plan, scale, softcap, sinks, workspace
        )

    n = plan.rows.shape[0]
    qf = q[plan.rows].reshape(n, hk, h // hk, d).float()  # [G, H_kv, group, D]: heads sharing a kv head

    # Part B: each grouped request's blocks after the shared ones, gathered per request.
    shape = (n, plan.length, hk, d)  # [G, L, H_kv, D]
    keys = _gather(k_cache, plan.pages, workspace, "k").view(shape).transpose(1, 2).float()  # [G, H_kv, L, D]
    values = _gather(v_cache, plan.pages, workspace, "v").view(shape).transpose(1, 2).float()
    part, lse = _partial(qf, keys, values, plan.visible, scale, softcap)  # [G, H_kv, group, D], [G, H_kv, group]

    # Part A: each group's shared blocks, gathered once; the group's queries side by side in one matmul.
    for span, first in plan.groups:
        members = span.stop - span.start
        ks = k_cache.index_select(0, first).flatten(0, 1).transpose(0, 1).float()  # [H_kv, shared * bs, D]
        vs = v_cache.index_select(0, first).flatten(0, 1).transpose(0, 1).float()
        qg = qf[span].transpose(0, 1).reshape(hk, -1, d)  # [H_kv, n_g * group, D]
        part_a, lse_a = _partial(qg, ks, vs, None, scale, softcap)  # [H_kv, n_g * group, D], [H_kv, n_g * group]
        part_a = part_a.view(hk, members, -1, d).transpose(0, 1)  # [n_g, H_kv, group, D]
        lse_a = lse_a.view(hk, members, -1).transpose(0, 1)  # [n_g, H_kv, group]
        total = torch.logaddexp(lse_a, lse[span])  # [n_g, H_kv, group]; lse_a is finite (full blocks)
        merged = part_a * (lse_a - total).exp().unsqueeze(-1) + part[span] * (lse[span] - total).exp().unsqueeze(-1)
        part[span], lse[span] = merged, total

    if sinks is not None:  # a sink logit joins the denominator only: rescale by lse / (lse + sink)
        sink = sinks.float().view(1, hk, h // hk)  # [1, H_kv, group]
        part = part * (lse - torch.logaddexp(lse, sink)).exp().unsqueeze(-1)
    out[plan.rows] = part.reshape(n, 1, h, d).to(q.dtype)  # [G, 1, H, D]
    return out


def _decode_plain(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    buckets: list[_PlainPlan],
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    workspace: dict | None,
) -> torch.Tensor:
    """Each length bucket gathers its requests' pages and attends in one batched call.
    q [B, 1, H, D] -> [B, 1, H, D] in q.dtype."""
    if len(buckets) == 1 and buckets[0].rows is None:
        return _decode_bucket(q, k_cache, v_cache, buckets[0], scale, softcap, sinks, workspace)
    out = torch.empty_like(q)  # [B, 1, H, D]: the buckets cover every row
    for bucket in buckets:
        out[bucket.rows] = _decode_bucket(q[bucket.rows], k_cache, v_cache, bucket, scale, softcap, sinks, workspace)
    return out


def _decode_bucket(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _PlainPlan,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    workspace: dict | None,
) -> torch.Tensor:
    """One bucket: q [B, 1, H, D] of its rows -> [B, 1, H, D] in q.dtype."""
    if plan.pages is None:
        return torch.zeros_like(q)
    b, _, h, d = q.shape
    hk = k_cache.shape[2]
    shape = (b, plan.length, hk, d)  # [B, L, H_kv, D]
    keys = _gather(k_cache, plan.pages, workspace, "k").view(shape).transpose(1, 2).to(q.dtype)  # [B, H_kv, L, D]
    values = _gather(v_cache, plan.pages, workspace, "v").view(shape).transpose(1, 2).to(q.dtype)
    if softcap > 0 or sinks is not None:
        out = explicit_attention(q.transpose(1, 2), keys, values, plan.mask, scale, softcap, sinks)  # [B, H, 1, D]
    else:  # one query token: the group's heads folded into the query axis, the mask broadcasts as is
        folded = q.reshape(b, hk, h // hk, d)  # [B, H_kv, group, D]
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=plan.mask, scale=scale)
        out = out.view(b, h, 1, d)  # [B, H, 1, D]
    if plan.blank is not None:  # a request that sees no key outputs zeros (flash-attn), never NaN
        out = out.masked_fill(plan.blank, 0.0)
    return out.transpose(1, 2).to(q.dtype)  # [B, 1, H, D]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_k: int | None = None,
    *,
    options: AttentionOptions,
    memo: dict | None = None,
) -> torch.Tensor:
    """One-token decode over a paged KV cache (flash-attn ``flash_attn_with_kvcache`` semantics).

    q [B, 1, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; k, v [B, 1, H_kv, D] or None;
    cache_seqlens int32 [B] (length before appending); block_table int32 [B, max_blocks], -1 = unallocated.
    ``max_seqlen_k``: an upper bound of the keys a request attends (sizes the native kernel's
    threading; None: read from ``cache_seqlens``). ``memo``: a dict that lives for one forward
    (``kernels/base.py``): the layer-independent work (gather indices, masks, cascade groups) is done
    by the first layer and reused by the others, and the gather buffers are reused across layers and
    steps. Every call with one memo must pass the same ``cache_seqlens`` and ``block_table``.
    int8 pages (``options.k_scales``, ``v_scales``): the new token is quantized in, then the step runs as a
    prefill of one query per request (``_decode_int8``). Returns [B, 1, H, D] in q.dtype.
    """
    appended = k is not None and v is not None
    if options.k_scales is not None:
        return _decode_int8(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options, memo)
    softmax_scale, causal, window_size = options.softmax_scale, options.causal, options.window_size
    softcap, sinks = options.softcap, options.sinks
    if q.device.type == "cpu":  # the native kernel reads the pages in place (cpu_native.py)
        max_len = max_seqlen_k if max_seqlen_k is not None else memo.get("max_len") if memo is not None else None
        if max_len is None:  # read back from the device once per forward
            max_len = int(cache_seqlens.max()) + appended if cache_seqlens.numel() else 0
            if memo is not None:
                memo["max_len"] = max_len
        window_left = window_size[0]
        out = cpu_native.paged_decode(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, window_left, softcap, sinks, max_len
        )
        if out is not None:
            return out
    key = ("decode", k_cache.shape[1], appended, causal, tuple(window_size))
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        block_bytes = k_cache[0].numel() * k_cache.element_size() + v_cache[0].numel() * v_cache.element_size()
        plan = _decode_plan(
            cache_seqlens, block_table, k_cache.shape[1], appended, causal, tuple(window_size), block_bytes
        )
        if memo is not None:
            memo[key] = plan
    if appended:
        _append(k_cache, v_cache, k, v, plan.slots)
    workspace = _workspace(memo, k_cache)
    if plan.cascade is not None:
        return _decode_cascade(q, k_cache, v_cache, plan.cascade, softmax_scale, softcap, sinks, workspace)
    return _decode_plain(q, k_cache, v_cache, plan.plain, softmax_scale, softcap, sinks, workspace)




def _decode_int8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    options: AttentionOptions,
    memo: dict | None,
) -> torch.Tensor:
    """Decode on int8 pages: the new K/V [B, 1, H_kv, D] (if any) quantized into their slots with their scales,
    then every request's keys gathered, dequantized and attended as a one-query prefill row (bottom-right
    causal: the query sees every key). Neither the native kernels nor the planner above read per-key scales.
    Returns [B, 1, H, D]."""
    k_scales, v_scales = options.k_scales, options.v_scales
    assert k_scales is not None and v_scales is not None
    if k is not None and v is not None:
        block_size = k_cache.shape[1]
        pos = cache_seqlens.long()  # [B]
        slots = block_table.gather(1, (pos // block_size).unsqueeze(1))[:, 0].long() * block_size + pos % block_size
        write_pages(k_cache, k_scales, k[:, 0], slots)
        write_pages(v_cache, v_scales, v[:, 0], slots)
        cache_seqlens = cache_seqlens + 1
    b = q.shape[0]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    out = paged_prefill_attention(q[:, 0], k_cache, v_cache, cu_q, cache_seqlens.to(torch.int32), block_table, 1,
                                  options=options, memo=memo)  # fmt: skip
    return out.unsqueeze(1)  # [B, 1, H, D]
