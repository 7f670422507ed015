"""The Triton backend's kernels and their host-side launchers (``triton_backend.py`` holds the
backend class, which imports this module only when a kernel first runs): paged decode, varlen
prefill straight from the pages, and the K/V page writer.

Entry points (shapes as in ``hf_paged_attn.kernels``):

* ``paged_decode_attention``: one query token per request, K/V read through ``block_table``.
  One program handles *all* query heads of one KV head (GQA), so each K/V tile is loaded once per
  KV head rather than once per query head; long contexts are split over several programs (split-K,
  "flash-decoding") whose partial results a second kernel merges.
* ``paged_prefill_attention``: packed queries against each request's first ``seqused_k[b]`` keys
  read straight from the pages, so the varlen path needs no gather into a packed K/V copy.
* ``write_kv``: scatter new K/V into the pages through a slot mapping (``-1`` skips a token).

All maths is fp32 with the softmax in base 2 (``exp2``), whatever the storage dtype. Block sizes
(tokens per page) must be powers of two from 16 up: a key tile never straddles two pages, so each
tile costs a single block-table lookup. Runs on CUDA/ROCm, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests run it).
"""

from __future__ import annotations

import functools

import torch

from .base import AttentionOptions, power_of_two_at_least_16
from .kv_dtype import is_fp8, to_pages, writable, write_pages

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError(
        "The 'triton' kernel backend needs the triton package: `pip install triton` (CUDA builds of "
        "torch ship it). On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors."
    ) from exc

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]


# Tile sizes. Decode is memory bound: tiles only need to be big enough to keep loads wide.
_DECODE_BLOCK_N = 64  # keys per decode loop iteration (halved for head_dim > 128)
_PREFILL_BLOCK_M = 64  # rows of a query tile = queries x (padded) query heads of one KV head
_PREFILL_BLOCK_N = 64
# Split-K (see _choose_num_splits). The launch knobs are module constants so that
# scripts/gpu_check/ can sweep them on a GPU; None leaves Triton's default.
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 256  # below this, a split-K partition costs more than it saves
_MAX_SPLITS = 128
_REDUCE_CHUNK_S = 16  # splits merged per reduce iteration
_DECODE_NUM_WARPS: int | None = None
_DECODE_NUM_STAGES: int | None = None


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # No tanh that works both under the interpreter and on every GPU target; this form never
    # overflows (exp2 of a non-positive number) and is accurate to fp32 rounding.
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores_log2(s, softmax_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw q.k products -> logits in base 2 (ready for exp2), with optional soft-capping."""
    if SOFTCAP:
        s = s * softmax_scale
        s = softcap * _tanh(s / softcap)
        s = s * 1.4426950408889634
    else:
        s = s * (softmax_scale * 1.4426950408889634)
    return s


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b with an fp32 result. DOT_FP32 computes in IEEE fp32: for fp32 inputs (the default would
    be TF32 on tensor cores, ~1e-3 error), and under the interpreter, whose dot mishandles bf16."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(num_tokens, BLOCK_T), cdiv(num_kv_heads, BLOCK_H)): copy BLOCK_T tokens' K/V heads
    into their slots (a program per token would be mostly launch overhead for small heads)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]  # [BLOCK_T, 1, 1]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]  # [1, BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, None, :]  # [1, 1, BLOCK_D]
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)  # [BLOCK_T, 1, 1]
    # slot -1 (padding, or a token whose K/V must not be stored) is masked out, not branched on, and
    # clamped so that no negative address is ever formed.
    keep = t_ok & (slot >= 0)
    slot = tl.maximum(slot, 0)
    blk = slot // block_size
    off = slot % block_size
    mask = keep & (h < num_kv_heads) & (d < head_dim)  # [BLOCK_T, BLOCK_H, BLOCK_D]
    key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs
    tl.store(k_dst + h * stride_kch + d * stride_kcd, key, mask=mask)
    tl.store(v_dst + h * stride_vch + d * stride_vcd, val, mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, seqlens_ptr, block_table_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    softmax_scale, softcap, window_left,
    group, head_dim, num_splits, min_tiles_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_knb, stride_knh, stride_knd,
    stride_vnb, stride_vnh, stride_vnd,
    stride_btb, stride_bts,
    stride_ob, stride_oh, stride_od,
    PAGE: tl.constexpr, NEW_TOKEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Grid (batch, num_kv_heads, num_splits).

    Program (b, kvh, s) attends the ``group`` query heads of KV head ``kvh`` over the s-th share of
    request b's visible key tiles. With ``SPLIT`` it writes a normalised partial output and its
    base-2 log-sum-exp to part_out [B, H, S, D] / part_lse [B, H, S] (contiguous, fp32) for
    ``_decode_reduce_kernel``; otherwise it finishes the softmax (sinks included) itself.

    NEW_TOKEN: the new token's K/V (k_new/v_new [B, H_kv, D]) belong at position cache_len. Split 0
    of each (b, kvh) stores them into their slot and attends them from registers as one more key
    (the softmax merge does not care which split holds a key); every program masks that position
    out of its cache loads, so no program reads the slot while it is written and the append needs
    no launch of its own.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    cache_len = tl.load(seqlens_ptr + b).to(tl.int32)  # keys already in the pages
    seq_len = cache_len + NEW_TOKEN  # keys the query attends
    # The query sits at position seq_len - 1; causality hides nothing (no later key exists), only a
    # left window can: keys j >= seq_len - 1 - window_left. The new token is always visible.
    win_start = 0
    if HAS_WINDOW:
        win_start = tl.maximum(seq_len - 1 - window_left, 0)
    tile_lo = win_start // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    # Split per request (not over a fixed max length) so that every split of a short request gets
    # work too, but never fewer than min_tiles_per_split tiles a split: the host sizes num_splits
    # from the block table's width, an upper bound. A split left with no tile writes lse = -inf and
    # is ignored by the reduce.
    per_split = tl.maximum(tl.cdiv(tile_hi - tile_lo, num_splits), min_tiles_per_split)
    my_lo = tile_lo + split * per_split
    my_hi = tl.minimum(my_lo + per_split, tile_hi)

    g = tl.arange(0, BLOCK_G)  # query head inside the group
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < group
    d_ok = d < head_dim
    heads = kvh * group + g  # [BLOCK_G] absolute query heads
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (base 2)
    l = tl.zeros([BLOCK_G], tl.float32)  # running denominator  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_btb
    k_head = k_cache_ptr + kvh * stride_kh + d[None, :] * stride_kd  # [1, BLOCK_D] this KV head
    v_head = v_cache_ptr + kvh * stride_vh + d[None, :] * stride_vd
    for tile in range(my_lo, my_hi):
        j0 = tile * BLOCK_N
        j = j0 + n  # [BLOCK_N] absolute key positions
        k_ok = (j < cache_len) & (j >= win_start)  # the new token's slot is never read
        if BLOCK_N <= PAGE:
            # Both powers of two: the whole tile lies in one page, one block-table lookup.
            page = tl.load(bt_row + (j0 // PAGE) * stride_bts).to(tl.int64)
            k_rows = page * stride_kb + (j % PAGE) * stride_ks  # [BLOCK_N] element offsets
            v_rows = page * stride_vb + (j % PAGE) * stride_vs
        else:
            # Small pages: the tile spans BLOCK_N // PAGE of them, one lookup per key (cached), so a
            # loop iteration still moves a wide tile.
            pages = tl.load(bt_row + (j // PAGE) * stride_bts, mask=k_ok, other=0).to(tl.int64)
            k_rows = pages * stride_kb + (j % PAGE) * stride_ks
            v_rows = pages * stride_vb + (j % PAGE) * stride_vs
        kv_mask = k_ok[:, None] & d_ok[None, :]
        # fp8 pages widen to the query's dtype as they load (a no-op for pages of the model's dtype)
        key = tl.load(k_head + k_rows[:, None], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(key), DOT_FP32)  # [BLOCK_G, BLOCK_N]
        s = _scores_log2(s, softmax_scale, softcap, SOFTCAP)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid -inf - -inf = nan
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        val = tl.load(v_head + v_rows[:, None], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(val.dtype), val, DOT_FP32)
        m = m_new

    if NEW_TOKEN:
        # Split 0 owns the new token: it exists for every request, whatever the window and length.
        # Masks are built as blocks: the interpreter rejects block & scalar.
        owner = (split == 0).to(tl.int32)
        own_d = (tl.zeros([BLOCK_D], tl.int32) + owner) != 0  # [BLOCK_D]
        new_mask = d_ok & own_d
        dtype = k_cache_ptr.dtype.element_ty
        k_new = tl.load(k_new_ptr + b.to(tl.int64) * stride_knb + kvh * stride_knh + d * stride_knd,
                        mask=new_mask, other=0.0).to(dtype)  # fmt: skip
        v_new = tl.load(v_new_ptr + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + d * stride_vnd,
                        mask=new_mask, other=0.0).to(dtype)  # fmt: skip
        # Append: slot = block_table[b, cache_len // PAGE] * PAGE + cache_len % PAGE; an
        # unallocated block (-1) skips the store, and no negative address is ever formed.
        dst = tl.load(bt_row + (cache_len // PAGE) * stride_bts).to(tl.int64)
        keep = new_mask & ((tl.zeros([BLOCK_D], tl.int64) + dst) >= 0)
        dst = tl.maximum(dst, 0)
        off = cache_len % PAGE
        tl.store(k_cache_ptr + dst * stride_kb + off * stride_ks + kvh * stride_kh + d * stride_kd, k_new, mask=keep)
        tl.store(v_cache_ptr + dst * stride_vb + off * stride_vs + kvh * stride_vh + d * stride_vd, v_new, mask=keep)
        # Attend it as one more key column, from registers (as the cache would hold it).
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)  # [BLOCK_G]
        s_new = _scores_log2(s_new, softmax_scale, softcap, SOFTCAP)
        own_g = (tl.zeros([BLOCK_G], tl.int32) + owner) != 0
        s_new = tl.where(own_g, s_new, float("-inf"))
        m_new = tl.maximum(m, s_new)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p_new = tl.exp2(s_new - m_use)  # [BLOCK_G], 0 outside the owner
        l = l * alpha + p_new  # noqa: E741
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new

    if SPLIT:
        row = (b * group * tl.num_programs(1) + heads) * num_splits + split  # [BLOCK_G] in [B, H, S]
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        part = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(part_lse_ptr + row, lse, mask=g_ok)
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], part, mask=g_ok[:, None])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only: rescale to a common max and add it.
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m, sink)
            rescale = tl.exp2(m - m_fin)
            l = l * rescale + tl.exp2(sink - m_fin)  # noqa: E741
            acc = acc * rescale[:, None]
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # no visible key and no sink: zeros
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr,
    num_heads, head_dim, num_splits,
    stride_ob, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Grid (batch, num_heads): merge the split-K partials of one (request, head).

    All log-sum-exps at once (BLOCK_S >= num_splits, small), the partial outputs CHUNK_S splits at a
    time so that a hundred splits of a wide head do not spill registers.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = (b * num_heads + h) * num_splits  # first row of this (request, head) in [B, H, S]
    lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m), 0)  # empty splits weigh 0
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    acc = tl.zeros([BLOCK_D], tl.float32)
    c = tl.arange(0, CHUNK_S)
    for s0 in range(0, num_splits, CHUNK_S):
        c_ok = s0 + c < num_splits
        rows = base + s0 + c  # [CHUNK_S]
        w = tl.exp2(tl.load(part_lse_ptr + rows, mask=c_ok, other=float("-inf")) - m)  # [CHUNK_S]
        part = tl.load(part_out_ptr + rows[:, None] * BLOCK_D + d[None, :], mask=c_ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    out = acc / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, cu_q_ptr, k_len_ptr, block_table_ptr, sinks_ptr, out_ptr,
    softmax_scale, softcap, window_left, window_right,
    group, head_dim, block_size,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_bts,
    stride_ot, stride_oh, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(max_seqlen_q, BLOCK_M // BLOCK_G), batch, num_kv_heads).

    A tile's BLOCK_M rows are BLOCK_M // BLOCK_G consecutive queries times the BLOCK_G (padded)
    query heads of one KV head, so every K/V tile loaded serves the whole group.
    Keys are the first k_len[b] tokens of request b's pages (k_ptr/v_ptr are the caches, k_len_ptr
    is seqused_k).
    Query i of a request with Lq queries and Lk keys sits at absolute position Lk - Lq + i.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_G
    q_tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest request
    k_len = tl.load(k_len_ptr + b).to(tl.int32)

    r = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + r // BLOCK_G  # [BLOCK_M] query index inside the request
    g = r % BLOCK_G  # [BLOCK_M] query head inside the group
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok = d < head_dim
    row_ok = (qi < q_len) & (g < group)
    heads = kvh * group + g
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    pos = k_len - q_len + qi  # [BLOCK_M] absolute query positions

    # Key range any row of this tile can see; tiles outside it are never loaded.
    first_pos = k_len - q_len + q_tile * BLOCK_Q
    last_pos = k_len - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    lo = 0
    hi = k_len
    if HAS_LEFT:
        lo = tl.maximum(first_pos - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(last_pos + window_right + 1, k_len)
    lo = (lo // BLOCK_N) * BLOCK_N  # tile aligned, so a paged tile stays inside one page

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_btb
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + n  # [BLOCK_N] absolute key positions
        page = tl.load(bt_row + (j0 // block_size) * stride_bts).to(tl.int64)
        k_base = k_ptr + page * stride_kb + (j0 % block_size + n)[:, None] * stride_ks
        v_base = v_ptr + page * stride_vb + (j0 % block_size + n)[:, None] * stride_vs
        j_ok = j < k_len
        kv_mask = j_ok[:, None] & d_ok[None, :]
        key = tl.load(k_base + kvh * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(key), DOT_FP32)  # [BLOCK_M, BLOCK_N]
        s = _scores_log2(s, softmax_scale, softcap, SOFTCAP)
        visible = j_ok[None, :] & row_ok[:, None]
        if HAS_LEFT:
            visible &= j[None, :] >= pos[:, None] - window_left
        if HAS_RIGHT:
            visible &= j[None, :] <= pos[:, None] + window_right
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row so far: no nan
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        val = tl.load(v_base + kvh * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(val.dtype), val, DOT_FP32)
        m = m_new

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=g < group, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m, sink)
        rescale = tl.exp2(m - m_fin)
        l = l * rescale + tl.exp2(sink - m_fin)  # noqa: E741
        acc = acc * rescale[:, None]
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row that sees no key (and no sink): zeros
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

# TRITON_INTERPRET=1 at import time makes every kernel an InterpretedFunction (numpy on the CPU).
_INTERPRETED = type(_decode_kernel).__name__ == "InterpretedFunction"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate the page tensors [num_blocks, block_size, H_kv, D]; return the block size."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not power_of_two_at_least_16(k_cache.shape[1]):
        raise ValueError(
            f"the triton kernels need a block_size that is a power of two >= 16, got block_size={k_cache.shape[1]}"
        )
    return k_cache.shape[1]


def _check_heads(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return num_heads // num_kv_heads


def _effective_window(window_size: tuple[int, int], causal: bool) -> tuple[int, int]:
    """(left, right) with -1 = unbounded, causal folded in (it caps right at 0), as the reference."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _pow2(n: int, floor: int = 16) -> int:
    # tl.arange needs powers of two, and tl.dot needs every dimension >= 16 on GPUs.
    return max(floor, triton.next_power_of_2(n))


def _sinks_arg(sinks: torch.Tensor | None, num_heads: int, like: torch.Tensor) -> torch.Tensor:
    if sinks is None:
        return like  # never read (HAS_SINKS=False) but the kernel needs some pointer
    if sinks.numel() != num_heads:
        raise ValueError(f"sinks must have one logit per query head ({num_heads}), got {tuple(sinks.shape)}")
    return sinks.reshape(num_heads).contiguous()  # [H]


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: one "SM", so split-K only runs on long contexts or when asked for


def _choose_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Split-K partitions per (request, KV head): enough programs for _PROGRAMS_PER_SM on every SM
    (a decode program keeps few loads in flight, so one per SM cannot saturate HBM), but no split
    shorter than _MIN_TOKENS_PER_SPLIT tokens (below that the partials and the reduce cost more
    than the split saves) and at most _MAX_SPLITS.

    ``max_len`` is an upper bound on the context (block-table width x block size), known on the host
    without a device sync; the kernel also keeps each split of a shorter request that long.
    E.g. on 132 SMs with 8 KV heads: one 32K-token request -> 66 splits (528 programs of ~500
    tokens); 64 requests -> 2.
    """
    want = triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(1, batch * num_kv_heads))
    return max(1, min(want, max_len // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))


def _decode_block_n(head_dim: int) -> int:
    """Keys per loop iteration: wide enough to keep many bytes in flight, narrow enough for wide heads'
    registers. Independent of the page size (a tile may span pages)."""
    return _DECODE_BLOCK_N if head_dim <= 128 else _DECODE_BLOCK_N // 2


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into the pages in place.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: integer [num_tokens], slot = block * block_size + offset,
    -1 skips the token.
    """
    block_size = _check_cache(k_cache, v_cache)
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k/v must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] like the pages, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # fp8 pages: saturated and rounded here (kv_dtype.to_pages), copied as their bytes by the kernel
    k, v = to_pages(k, k_cache.dtype), to_pages(v, v_cache.dtype)
    k_cache, v_cache = writable(k_cache), writable(v_cache)
    block_d = triton.next_power_of_2(head_dim)
    # ~4K elements per program: enough to keep a warp group busy, few programs under the interpreter.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    block_t = min(triton.next_power_of_2(num_tokens), max(1, 4096 // (block_h * block_d)))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        num_tokens, num_kv_heads, head_dim, block_size,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """One new token per request against its paged context.

    q: [B, 1, H, D]; k_cache, v_cache: [num_blocks, block_size, H_kv, D]; k, v: [B, 1, H_kv, D] or
    None; cache_seqlens: int [B]; block_table: int [B, max_blocks], -1 unallocated. As
    flash-attn's ``flash_attn_with_kvcache`` (and the torch backend): with k/v, cache_seqlens is the
    length before appending, the new token is written at position cache_seqlens[b] and the query
    attends cache_seqlens[b] + 1 keys; without, it attends the cache_seqlens[b] keys already in the
    pages. ``causal`` and the right window cannot hide anything from the last token, and
    ``max_seqlen_k`` and ``memo`` are accepted for the protocol only (the split-K count follows
    from the block table's width, a shape). ``num_splits`` overrides the split-K
    heuristic (tests use it to force the reduce path). Returns [B, 1, H, D].

    One launch (the append is fused into the decode kernel), two when split-K needs the reduce.
    """
    softmax_scale, softcap, sinks = options.softmax_scale, options.softcap, options.sinks
    block_size = _check_cache(k_cache, v_cache)
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [batch, 1, num_heads, head_dim], got {tuple(q.shape)}")
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = _check_heads(num_heads, num_kv_heads)
    if k_cache.shape[3] != head_dim or (q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype)):
        raise ValueError(
            f"q [{head_dim}, {q.dtype}] and the pages [{k_cache.shape[3]}, {k_cache.dtype}] must share "
            "head_dim and dtype (or the pages be fp8)"
        )
    if (k is None) != (v is None):
        raise ValueError("pass both k and v, or neither")
    if k is not None and is_fp8(k_cache.dtype):
        # The fused append stores in the pages' dtype from registers; fp8 needs the saturating rounding of
        # kv_dtype.to_pages, so the new token goes in first (device ops only: graph-safe) and is read back.
        pos = cache_seqlens.long()  # [B]; its block must be allocated, as the engine does
        slots = block_table.gather(1, (pos // block_size).unsqueeze(1))[:, 0].long() * block_size + pos % block_size
        write_pages(k_cache, None, k.reshape(batch, num_kv_heads, head_dim), slots)
        write_pages(v_cache, None, v.reshape(batch, num_kv_heads, head_dim), slots)
        k = v = None
        cache_seqlens = cache_seqlens + 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, 1, H, D]
    if batch == 0:
        return out
    q3 = q[:, 0]  # [B, H, D] view
    out3 = out[:, 0]
    if k is not None:
        if k.shape != v.shape or k.numel() != batch * num_kv_heads * head_dim:
            raise ValueError(
                f"k/v must be [{batch}, 1, {num_kv_heads}, {head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        k3 = k.reshape(batch, num_kv_heads, head_dim)  # [B, H_kv, D], a view when it can be
        v3 = v.reshape(batch, num_kv_heads, head_dim)
    else:
        k3 = v3 = q3  # never read (NEW_TOKEN=False) but the kernel needs some pointer

    left, _ = _effective_window(options.window_size, options.causal)
    max_len = block_table.shape[1] * block_size
    block_d = _pow2(head_dim)
    block_n = _decode_block_n(head_dim)
    if num_splits:  # exactly as asked (tests force it onto short contexts)
        splits, min_tiles = int(num_splits), 1
    else:
        splits = _choose_num_splits(batch, num_kv_heads, max_len, _num_sms(q.device))
        min_tiles = triton.cdiv(_MIN_TOKENS_PER_SPLIT, block_n)
    splits = max(1, min(splits, triton.cdiv(max_len, block_n)))  # no more splits than tiles
    if splits > 1:
        # One allocation for both partials: [B, H, S, BLOCK_D] outputs, then [B, H, S] lse.
        rows = batch * num_heads * splits
        part = torch.empty(rows * (block_d + 1), dtype=torch.float32, device=q.device)
        part_out, part_lse = part[: rows * block_d], part[rows * block_d :]
    else:
        part_out = part_lse = out  # unused
    sinks_t = _sinks_arg(sinks, num_heads, q)
    launch = {}
    if _DECODE_NUM_WARPS:
        launch["num_warps"] = _DECODE_NUM_WARPS
    if _DECODE_NUM_STAGES:
        launch["num_stages"] = _DECODE_NUM_STAGES
    _decode_kernel[(batch, num_kv_heads, splits)](
        q3, k_cache, v_cache, k3, v3, cache_seqlens, block_table, sinks_t,
        out3, part_out, part_lse,
        float(softmax_scale), float(softcap), left,
        group, head_dim, splits, min_tiles,
        *q3.stride(), *k_cache.stride(), *v_cache.stride(), *k3.stride(), *v3.stride(),
        *block_table.stride(), *out3.stride(),
        PAGE=block_size, NEW_TOKEN=k is not None,
        BLOCK_G=_pow2(group), BLOCK_N=block_n, BLOCK_D=block_d,
        SOFTCAP=softcap > 0, HAS_WINDOW=left >= 0, HAS_SINKS=sinks is not None,
        SPLIT=splits > 1, DOT_FP32=q.dtype == torch.float32 or _INTERPRETED,
        **launch,
    )  # fmt: skip
    if splits > 1:
        block_s = triton.next_power_of_2(splits)
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, sinks_t, out3,
            num_heads, head_dim, splits,
            *out3.stride(),
            BLOCK_S=block_s, CHUNK_S=min(block_s, _REDUCE_CHUNK_S), BLOCK_D=block_d,
            HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    options: AttentionOptions,
) -> torch.Tensor:
    """The launcher of ``_prefill_kernel``."""
    softmax_scale, softcap, sinks = options.softmax_scale, options.softcap, options.sinks
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, num_heads, head_dim], got {tuple(q.shape)}")
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    group = _check_heads(num_heads, num_kv_heads)
    if k_cache.shape[-1] != head_dim or q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype) or (
        k_cache.shape != v_cache.shape
    ):
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype}, pages {tuple(k_cache.shape)} {k_cache.dtype} and "
            f"{tuple(v_cache.shape)} must share head_dim and dtype (or the pages be fp8)"
        )
    out = torch.zeros(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.numel() - 1
    if total_q == 0 or batch <= 0 or max_seqlen_q <= 0:
        return out
    left, right = _effective_window(options.window_size, options.causal)
    block_g = triton.next_power_of_2(group)
    block_m = max(_PREFILL_BLOCK_M, block_g)
    block_d = _pow2(head_dim)
    block_size = k_cache.shape[1]
    block_n = min(_PREFILL_BLOCK_N if head_dim <= 128 else 32, block_size)
    grid = (triton.cdiv(max_seqlen_q, block_m // block_g), batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, _sinks_arg(sinks, num_heads, q), out,
        float(softmax_scale), float(softcap), left, right,
        group, head_dim, block_size,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        SOFTCAP=softcap > 0, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SINKS=sinks is not None,
        DOT_FP32=q.dtype == torch.float32 or _INTERPRETED,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    options: AttentionOptions,
    memo: dict | None = None,
) -> torch.Tensor:
    """Packed queries against K/V read straight from the pages (no gather).

    q: [total_q, H, D]; k_cache, v_cache: [num_blocks, block_size, H_kv, D], already holding every
    key including this step's (write them first with ``write_kv``); cu_seqlens_q: int [B + 1];
    seqused_k: int [B], keys of request b = its first seqused_k[b] cached tokens; block_table: int
    [B, max_blocks]. Causal mask aligned bottom-right. ``max_seqlen_q`` sizes the
    grid; None reads it from cu_seqlens_q (a device sync). ``max_seqlen_k`` and ``memo`` are
    accepted for the protocol only (the kernel reads each request's length). Returns [total_q, H, D].
    """
    _check_cache(k_cache, v_cache)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    return _prefill(
        q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, int(max_seqlen_q), options
    )
