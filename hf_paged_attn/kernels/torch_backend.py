"""Pure-torch backend: what every CPU user runs, so it is vectorised and leans on SDPA.

On CPU its decode first tries the native kernel (``cpu_native``, ``kernels/cpu_decode.c``), which
reads the pages in place; what follows is the torch-ops path it falls back to (no C compiler,
float16, ``HF_PAGED_ATTN_NATIVE=0``) and the path on CUDA. The varlen path reads the pages too
(``PREFILL_FROM_PAGES``, at the end of this module): one-query requests of a mixed step go through
the decode kernel, prefilling requests' visible keys are gathered and bucketed as below.

Design (measured on CPU, see ``benchmarks/kernels_cpu.py``):

* varlen: requests are bucketed by (query length, key-length power of two) and each bucket is one
  padded, batched attention call. A uniform batch (all prefills of one shape) is one call on a view
  of the packed tensors; decode-like rows (q_len 1) of a mixed batch share a call with the rows of
  similar context length, and prefill chunks of one length likewise, so nothing pads to the longest.
  Padding inside a bucket is at most 2x on the key axis and is masked out.
* decode: requests are cut into at most three buckets of similar length; each bucket's pages are
  gathered into [bucket, its max_len, H_kv, D] in one indexing op, a length/window mask hides the
  tail, and one batched attention call does the rest. The query heads that share a kv head are
  folded into the query axis ([B, H_kv, group, D]), which runs 2-3x faster than SDPA's
  ``enable_gqa`` for a single query token. Everything that depends only on the block table and
  lengths (append slots, buckets, gather indices, masks, cascade groups) is computed by the first
  layer of a step and kept in the step's ``memo`` for the others, and on CPU the gathers go into one
  reused workspace: a fresh multi-MiB tensor per layer was page-faulted (zero-filled) by the kernel
  on every call. One step's decode attention ran 3-4x faster than before (``benchmarks/decode_step_cpu.py``).
* decode with shared prefixes (cascade): requests whose leading blocks are the same physical
  blocks (prefix caching, ``num_return_sequences`` forks) gather those blocks once per group and
  attend to them with one matmul; each request then gathers only the blocks after the shared ones,
  and the two partial softmaxes are merged through their log-sum-exps. On the ``shared-prefix``
  benchmark the per-request gather was 45% of the time before this.
* SDPA computes everything it can express; softcap and sinks can't go through it, so they take an
  explicit matmul + fp32 softmax path (chunked over queries to bound the score matrix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.blocks import blocks_for
from . import cpu_native

_MAX_SCORES = 1 << 25  # fp32 elements of one explicit score chunk (128 MiB)
STEP_MEMO = True  # paged_decode_attention takes ``memo=`` (StepMetadata.memo): see its docstring


def _visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, k_len: torch.Tensor, causal: bool, window: tuple[int, int]
) -> torch.Tensor:
    """Key visibility. q_pos [B, Lq, 1] absolute positions, k_pos [Lk], k_len [B, 1, 1] -> [B, Lq, Lk]."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    visible = k_pos < k_len  # [B, 1, Lk]: padding keys are never visible
    if left >= 0:
        visible = visible & (k_pos >= q_pos - left)
    if right >= 0:
        visible = visible & (k_pos <= q_pos + right)
    return visible.expand(-1, q_pos.shape[1], -1)  # [B, Lq, Lk]


def _explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Matmul + fp32 softmax (softcap, sinks). q [B, H, Lq, D]; k, v [B, H_kv, Lk, D]; mask [B, 1, Lq, Lk]."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    k, v = k.float().contiguous(), v.float().contiguous()  # matmul on strided views is ~4x slower
    step = max(1, _MAX_SCORES // max(1, b * h * lk))
    if lq > step:  # bound the [B, H, step, Lk] score matrix of long prompts
        parts = []
        for i in range(0, lq, step):
            part_mask = None if mask is None else mask[:, :, i : i + step]
            parts.append(_explicit(q[:, :, i : i + step], k, v, part_mask, scale, softcap, sinks))
        return torch.cat(parts, dim=2)
    qf = q.float().reshape(b, hk, h // hk * lq, d)  # [B, H_kv, group * Lq, D]: heads sharing a kv head
    scores = (qf @ k.transpose(-1, -2)).view(b, h, lq, lk).mul_(scale)  # [B, H, Lq, Lk]
    if softcap > 0:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, h, 1, 1).expand(b, h, lq, 1)  # [B, H, Lq, 1]
        scores = torch.cat([scores, sink], dim=-1)  # [B, H, Lq, Lk + 1]: the sink joins the denominator
    probs = scores.softmax(dim=-1)[..., :lk].reshape(b, hk, h // hk * lq, lk)  # [B, H_kv, group * Lq, Lk]
    return (probs @ v).view(b, h, lq, d).to(q.dtype)  # [B, H, Lq, D]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Batched attention. q [B, H, Lq, D]; k, v [B, H_kv, Lk, D]; mask bool [B, 1, Lq, Lk] -> [B, H, Lq, D].

    ``is_causal`` (only with ``mask=None``) means a square top-left causal mask. Rows seeing no key are zeros.
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    if is_causal and (softcap > 0 or sinks is not None):
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril().expand(b, 1, lq, lk)
    if softcap > 0 or sinks is not None:
        out = _explicit(q, k, v, mask, scale, softcap, sinks)
    elif lq == 1:  # one query token: fold the group's heads into the query axis, mask broadcasts as is
        folded = q.reshape(b, hk, h // hk, d)  # [B, H_kv, group, D]
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
        out = out.reshape(b, h, 1, d)  # [B, H, 1, D]
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=h != hk
        )
    if mask is not None:  # a query with no visible key outputs zeros (flash-attn), never NaN
        out = torch.where(mask.any(dim=-1, keepdim=True), out, 0.0)
    return out


def _rows(starts: list[int], lens: list[int], width: int, device: torch.device) -> slice | torch.Tensor:
    """Packed-token rows of requests padded to ``width``: a slice when they are contiguous and full,
    else a [B * width] index where padding repeats the request's last token (masked later)."""
    n = len(starts)
    if all(x == width for x in lens) and starts == list(range(starts[0], starts[0] + n * width, width)):
        return slice(starts[0], starts[0] + n * width)
    start = torch.tensor(starts, device=device).view(n, 1)  # [B, 1]
    last = torch.tensor(lens, device=device).view(n, 1) - 1  # [B, 1]
    pos = torch.arange(width, device=device).view(1, width)  # [1, width]
    return (start + torch.minimum(pos, last)).flatten()  # [B * width]


def _group_mask(
    q_len: int, k_lens: list[int], width: int, causal: bool, window: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(mask [B, 1, Lq, Lk] or None, is_causal) for requests sharing ``q_len``, keys padded to ``width``."""
    if all(x == width for x in k_lens) and tuple(window) == (-1, -1) and (not causal or q_len == width):
        return None, causal
    k_len = torch.tensor(k_lens, device=device).view(-1, 1, 1)  # [B, 1, 1]
    q_pos = k_len - q_len + torch.arange(q_len, device=device).view(1, -1, 1)  # [B, Lq, 1], bottom-right
    k_pos = torch.arange(width, device=device)  # [Lk]
    return _visible(q_pos, k_pos, k_len, causal, tuple(window)).unsqueeze(1), False


@dataclass(slots=True)
class _Bucket:
    """Requests attended in one padded call: their rows in the packed tensors and their mask."""

    q_len: int
    n: int  # requests
    width: int  # keys per request after padding
    q_rows: slice | torch.Tensor  # [n * q_len] packed query rows
    k_rows: slice | torch.Tensor  # [n * width] packed key rows (padding repeats a request's last key)
    mask: torch.Tensor | None  # bool [n, 1, q_len, width]
    is_causal: bool


def _varlen_plan(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool, window: tuple[int, int]
) -> tuple[list[_Bucket], bool]:
    """The buckets of a packed batch, and whether they cover every query row (else the rest are zeros)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    device = cu_seqlens_q.device
    groups: dict[tuple[int, int], list[int]] = {}
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > 0 and k_len > 0:  # no keys: the zeros below are the answer
            groups.setdefault((q_len, k_len.bit_length()), []).append(b)
    buckets = []
    for (q_len, _), reqs in groups.items():
        k_lens = [cu_k[b + 1] - cu_k[b] for b in reqs]
        width, n = max(k_lens), len(reqs)
        q_rows = _rows([cu_q[b] for b in reqs], [q_len] * n, q_len, device)
        k_rows = _rows([cu_k[b] for b in reqs], k_lens, width, device)
        mask, is_causal = _group_mask(q_len, k_lens, width, causal, window, device)
        buckets.append(_Bucket(q_len, n, width, q_rows, k_rows, mask, is_causal))
    covered = sum(b.n * b.q_len for b in buckets) == cu_q[-1]
    return buckets, covered


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    memo: dict | None = None,
) -> torch.Tensor:
    """Packed variable-length attention (flash-attn ``flash_attn_varlen_func`` semantics).

    q [total_q, H, D]; k, v [total_k, H_kv, D]; cu_seqlens_q / cu_seqlens_k int32 [batch + 1];
    sinks [H] -> [total_q, H, D] in q.dtype. ``max_seqlen_*`` are accepted for API parity only.
    ``memo``: a dict that lives for one step, as in ``paged_decode_attention`` (the bucketing, row
    indices and masks are made by the first layer); every call of a step passes the same cu_seqlens.
    """
    key = ("varlen", causal, tuple(window_size))
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        plan = _varlen_plan(cu_seqlens_q, cu_seqlens_k, causal, tuple(window_size))
        if memo is not None:
            memo[key] = plan
    buckets, covered = plan
    out = torch.empty_like(q) if covered else torch.zeros_like(q)  # [total_q, H, D]
    h, d = q.shape[1], q.shape[2]
    for bucket in buckets:
        n, q_len, width = bucket.n, bucket.q_len, bucket.width
        qp = q[bucket.q_rows].unflatten(0, (n, q_len)).transpose(1, 2)  # [B, H, Lq, D]
        kp = k[bucket.k_rows].unflatten(0, (n, width)).transpose(1, 2)  # [B, H_kv, Lk, D]
        vp = v[bucket.k_rows].unflatten(0, (n, width)).transpose(1, 2)  # [B, H_kv, Lk, D]
        res = _attend(qp, kp, vp, bucket.mask, bucket.is_causal, softmax_scale, softcap, sinks)  # [B, H, Lq, D]
        out[bucket.q_rows] = res.transpose(1, 2).reshape(n * q_len, h, d).to(q.dtype)  # [B * Lq, H, D]
    return out


CASCADE_MIN_TOKENS = 32  # shared tokens below which a group is not worth its own matmul
WORKSPACE_HEADROOM = 1.25  # a decode step's gather grows by a token per request: grow buffers ahead of it
# Fixed cost of one more length bucket in the plain decode path (indexing, two gathers, one SDPA call,
# the scatter of its rows), in bytes of K/V it would take to gather and attend to in that time
# (~100 us at ~5 GB/s on the 2-core CPU of benchmarks/README.md).
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
    mask = _visible(k_len - 1, k_pos, k_len, causal, tuple(window)).unsqueeze(1)  # [B, 1, 1, L]
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
    attention of the bundled model ~5x slower than its arithmetic. The step's memo shares one
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
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new[:, 0].to(cache.dtype))  # [B, H_kv, D]
        else:
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = new[:, 0].to(cache.dtype)


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
        out = _explicit(q.transpose(1, 2), keys, values, plan.mask, scale, softcap, sinks)  # [B, H, 1, D]
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
    *,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    memo: dict | None = None,
) -> torch.Tensor:
    """One-token decode over a paged KV cache (flash-attn ``flash_attn_with_kvcache`` semantics).

    q [B, 1, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; k, v [B, 1, H_kv, D] or None;
    cache_seqlens int32 [B] (length before appending); block_table int32 [B, max_blocks], -1 = unallocated.
    ``memo``: a dict that lives for one step (``StepMetadata.memo``): the layer-independent work (gather
    indices, masks, cascade groups) is done by the first layer and reused by the others, and the gather
    buffers are reused across layers and steps. Every call of one step must pass the same
    ``cache_seqlens`` and ``block_table``. Returns [B, 1, H, D] in q.dtype.
    """
    appended = k is not None and v is not None
    if q.device.type == "cpu":  # the native kernel reads the pages in place (cpu_native.py)
        max_len = memo.get("max_len") if memo is not None else None
        if max_len is None:
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


# ---------------------------------------------------------------------------------------------- varlen from pages
# The varlen path reads the pages (``PREFILL_FROM_PAGES``): the cache writes a step's new K/V with
# ``write_kv`` and gathers nothing. On CPU, requests that feed one token in a mixed step (decodes
# next to a prefill) are attended in place by the native decode kernel; the prefilling requests'
# visible keys are gathered from the pages and attended as before (``varlen_attention``). Before,
# the cache gathered every request's whole context, decodes included, at every layer.
PREFILL_FROM_PAGES = True


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [N, H_kv, D] written at the flat slots [N] of the pages [num_blocks, block_size, H_kv, D]."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, new.to(cache.dtype))


@dataclass(slots=True)
class _PagedVarlenPlan:
    """Layer-independent part of ``paged_prefill_attention`` for one step (its ``memo``)."""

    one_rows: torch.Tensor | None  # [n] query rows of the requests attended in place (one query each)
    one_lens: torch.Tensor | None  # [n] int32 keys each attends
    one_table: torch.Tensor | None  # [n, W] int32 their block tables
    one_max: int
    rows: torch.Tensor | None  # [Nq] query rows of the gathered requests, packed
    slots: torch.Tensor | None  # [K] flat slots of their visible keys, packed
    cu_q: torch.Tensor | None  # [R + 1] int32
    cu_k: torch.Tensor | None  # [R + 1] int32
    memo: dict  # varlen_attention's own plan for the gathered requests


def _paged_varlen_plan(
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    window_left: int,
    in_place: bool,
) -> _PagedVarlenPlan:
    """Which requests are attended in place (``in_place``: one query each) and which gathered: for
    those, the slots of the keys their queries can see (from the first query's window on: the
    blocks before it may already be freed)."""
    cu_q, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    ones = [b for b, n in enumerate(q_lens) if n == 1 and used[b] > 0] if in_place else []
    gathered = [b for b, n in enumerate(q_lens) if n > (1 if in_place else 0) and used[b] > 0]
    device = block_table.device
    plan = _PagedVarlenPlan(None, None, None, 0, None, None, None, None, {})
    if ones:
        index = torch.tensor(ones, device=device)
        plan.one_rows = torch.tensor([cu_q[b] for b in ones], device=device)
        plan.one_lens = seqused_k[index].to(torch.int32).contiguous()
        plan.one_table = block_table[index].to(torch.int32).contiguous()
        plan.one_max = max(used[b] for b in ones)
    if gathered:
        starts = [max(used[b] - q_lens[b] - window_left, 0) if window_left >= 0 else 0 for b in gathered]
        k_lens = [used[b] - s for b, s in zip(gathered, starts)]
        rows_k = torch.repeat_interleave(torch.tensor(gathered), torch.tensor(k_lens)).to(device)  # [K] request
        positions = torch.cat([torch.arange(s, used[b]) for b, s in zip(gathered, starts)]).to(device)  # [K]
        pages = block_table[rows_k, positions // block_size].long().clamp_min(0)  # [K]
        plan.slots = pages * block_size + positions % block_size
        plan.rows = torch.cat([torch.arange(cu_q[b], cu_q[b + 1]) for b in gathered]).to(device)
        plan.cu_q = torch.tensor([0, *torch.tensor([q_lens[b] for b in gathered]).cumsum(0).tolist()],
                                 dtype=torch.int32, device=device)  # fmt: skip
        plan.cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return plan


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int | None = None,
    *,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    memo: dict | None = None,
) -> torch.Tensor:
    """Packed queries against each request's first ``seqused_k[b]`` keys, read from the pages (the
    step's own K/V already written there). Semantics of ``varlen_attention`` (bottom-right causal);
    q [total_q, H, D], pages [num_blocks, block_size, H_kv, D], block_table int32 [B, W]. ``memo``:
    the step's dict, as in ``paged_decode_attention``. Returns [total_q, H, D] in q.dtype."""
    block_size = k_cache.shape[1]
    window = tuple(window_size)
    native_dtype = q.dtype in (torch.float32, torch.bfloat16)
    in_place = q.device.type == "cpu" and native_dtype and cpu_native.library() is not None
    key = ("paged_varlen", block_size, causal, window, in_place)
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        plan = _paged_varlen_plan(cu_seqlens_q, seqused_k, block_table, block_size, window[0], in_place)
        if memo is not None:
            memo[key] = plan
    out = torch.zeros_like(q)  # [total_q, H, D]; requests without keys or queries stay zeros
    if plan.one_rows is not None:
        one = cpu_native.paged_decode(
            q[plan.one_rows].unsqueeze(1), k_cache, v_cache, None, None, plan.one_lens, plan.one_table,
            softmax_scale, window[0], softcap, sinks, plan.one_max,
        )  # fmt: skip
        if one is None:  # a layout the native kernel does not read: this step gathers everything
            plan = _paged_varlen_plan(cu_seqlens_q, seqused_k, block_table, block_size, window[0], False)
            if memo is not None:
                memo[key] = plan
        else:
            out[plan.one_rows] = one[:, 0]
    if plan.rows is not None:
        hk, d = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.view(-1, hk, d).index_select(0, plan.slots)  # [K, H_kv, D]
        values = v_cache.view(-1, hk, d).index_select(0, plan.slots)
        out[plan.rows] = varlen_attention(
            q[plan.rows], keys, values, plan.cu_q, plan.cu_k, 0, 0, softmax_scale=softmax_scale, causal=causal,
            window_size=window, softcap=softcap, sinks=sinks, memo=plan.memo,
        )  # fmt: skip
    return out
