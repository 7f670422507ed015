"""Batched LoRA in Triton: Punica's segmented matmul pair (SGMV) for rows under many adapters at once.

A step's packed rows [N] each carry their adapter's *slot* (``token_slot``: 0..S-1, -1 for none: the
base model). ``lora_segments`` groups the rows by slot once per step (a stable sort, on the device, no
host sync), and every LoRA layer of the step reuses it:

* ``lora_shrink``: ``t[n] = A_l x[n]`` for each row n under adapter l: x [N, in], the layer's A stack
  [L, R, in] -> t [N, R] float32;
* ``lora_expand``: ``y[n] += scaling_l * B_l t[n]`` in place: y [N, out], the B stack [L, out, R].

``lora_ids`` [S] maps a slot to its adapter's index in this layer's stacks, -1 where the layer does not
hold that adapter (its target modules differ): the slots are the step's, the stacks the layer's, so one
grouping serves every layer. Ranks may differ per adapter: a stack is padded to R = the largest rank
with zeros, which add nothing to either product.

Why a per-row slot sorted on the device rather than sorted segments from the host (vLLM's older
``sgmv_*``, which take ``b_seq_start_loc`` / ``seq_len`` per request): the engine's row groups are not
always runs (a request's draft rows, requests of one adapter that are not neighbours), and the sort
gathers them without copying x into adapter order or syncing to learn the segments' lengths. This is
vLLM v1's design (``lora_shrink_op`` / ``lora_expand_op``: ``token_indices_sorted_by_lora_ids``,
``num_tokens_per_lora``, ``lora_token_start_loc``); BGMV (one program per row) is the special case of
one-row segments, so there is no second kernel for decode.

Grid: (row tiles, [output tiles,] slots). The row-tile count is N's (the longest a segment can be), so
launching needs no host sync; a program whose tile is past its segment's end returns at once.

Arithmetic, as PEFT's ``lora_B(lora_A(x.to(w.dtype))) * scaling`` up to the rounding of the sums: x is
cast to A's dtype, the shrink accumulates in float32 and stores float32, the expand casts t to B's dtype
(PEFT's intermediate is in the weights' dtype), accumulates in float32, scales, adds y in float32 and
rounds once to y's dtype. fp32 weights multiply in IEEE fp32 (Triton's default would be TF32).

Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run it). Not tuned: no
split-K in the shrink (vLLM splits its long ``in`` axis), one tile shape for every size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError("the LoRA kernels need the triton package (CUDA builds of torch ship it)") from exc

__all__ = ["Segments", "lora_expand", "lora_segments", "lora_shrink", "stack_padded"]

_BLOCK_M = 16  # rows per tile: tl.dot's minimum, since decode segments are short
_BLOCK_K = 64  # input features per shrink iteration
_BLOCK_N = 64  # output features per expand program


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b, float32 result. DOT_FP32: IEEE fp32 (fp32 weights; and the interpreter, whose bf16 dot is wrong)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _segment_rows(rows_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """This program's rows of the slot's segment (int64 [BLOCK_M]) and their mask; count 0 past its end."""
    count = tl.load(counts_ptr + slot)
    start = tl.load(starts_ptr + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(rows_ptr + start + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask, count


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, t_ptr, rows_ptr, counts_ptr, starts_ptr, lora_ids_ptr,
    K, R,
    stride_xm, stride_xk, stride_al, stride_ar, stride_ak, stride_tm, stride_tr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    lora = tl.load(lora_ids_ptr + slot)
    count = tl.load(counts_ptr + slot)
    if (lora < 0) | (pid_m * BLOCK_M >= count):  # the layer lacks this adapter, or the tile is past the segment
        return
    rows, mask_m, count = _segment_rows(rows_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    a_base = a_ptr + lora.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]  # fmt: skip
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]: A^T  # fmt: skip
        acc += _dot(x.to(a.dtype), a, DOT_FP32)
    tl.store(t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr, acc,
             mask=mask_m[:, None] & mask_r[None, :])  # fmt: skip


@triton.jit
def _expand_kernel(
    y_ptr, t_ptr, b_ptr, scalings_ptr, rows_ptr, counts_ptr, starts_ptr, lora_ids_ptr,
    N_OUT, R,
    stride_ym, stride_yn, stride_tm, stride_tr, stride_bl, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    lora = tl.load(lora_ids_ptr + slot)
    count = tl.load(counts_ptr + slot)
    if (lora < 0) | (pid_m * BLOCK_M >= count):
        return
    rows, mask_m, count = _segment_rows(rows_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N_OUT
    b_base = b_ptr + lora.to(tl.int64) * stride_bl
    b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B^T  # fmt: skip
    t = tl.load(t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr,
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] float32  # fmt: skip
    scaling = tl.load(scalings_ptr + lora)
    delta = _dot(t.to(b.dtype), b, DOT_FP32) * scaling  # [BLOCK_M, BLOCK_N] float32
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


# TRITON_INTERPRET=1 at import time makes every kernel an InterpretedFunction (numpy on the CPU).
_INTERPRETED = type(_shrink_kernel).__name__ == "InterpretedFunction"


class Segments(NamedTuple):
    """A step's rows grouped by adapter slot (``lora_segments``): ``rows`` int32 [N], the row indices
    sorted by slot (the rows without an adapter first); ``counts`` / ``starts`` int32 [S], each slot's
    number of rows and its first position in ``rows``."""

    rows: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor


def lora_segments(token_slot: torch.Tensor, num_slots: int) -> Segments:
    """Group rows by ``token_slot`` [N] (ints in -1..num_slots-1, -1: no adapter). A value past
    ``num_slots`` is an error (an index error on the CPU, a device assert on CUDA)."""
    slot = token_slot.reshape(-1).long()  # [N]
    rows = torch.argsort(slot, stable=True)  # [N]: slot -1 first, then 0, 1, ...
    # scatter_add_ rather than bincount, which syncs with the host to size its result on CUDA
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=slot.device)
    counts.scatter_add_(0, slot + 1, torch.ones_like(slot))  # [S+1], entry 0: the rows without an adapter
    starts = torch.cumsum(counts, 0) - counts  # [S+1], exclusive
    return Segments(rows.int(), counts[1:].int().contiguous(), starts[1:].int().contiguous())


def stack_padded(weights: list[torch.Tensor], rank_dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One stack [L, ...] of the adapters' A [r_l, in] (``rank_dim=0``) or B [out, r_l] (``rank_dim=1``)
    weights, each padded along its rank to the largest with zeros (which add nothing to the products)."""
    rank = max(w.shape[rank_dim] for w in weights)
    shape = list(weights[0].shape)
    shape[rank_dim] = rank
    dtype = dtype or weights[0].dtype
    stack = torch.zeros(len(weights), *shape, dtype=dtype, device=weights[0].device)  # [L, R, in] or [L, out, R]
    for i, w in enumerate(weights):
        stack[i].narrow(rank_dim, 0, w.shape[rank_dim]).copy_(w)
    return stack


def _block(n: int) -> int:
    # tl.arange needs powers of two, and tl.dot needs every dimension >= 16 on GPUs
    return max(16, triton.next_power_of_2(n))


def _lora_ids(lora_ids: torch.Tensor | None, segments: Segments, num_loras: int) -> torch.Tensor:
    num_slots = segments.counts.numel()
    if lora_ids is None:
        if num_slots != num_loras:
            raise ValueError(f"without lora_ids the {num_slots} slots must be the stack's {num_loras} adapters")
        return torch.arange(num_slots, dtype=torch.int32, device=segments.counts.device)
    if lora_ids.numel() != num_slots:
        raise ValueError(f"lora_ids has {lora_ids.numel()} entries for {num_slots} slots")
    return lora_ids.reshape(num_slots).int()


def lora_shrink(
    x: torch.Tensor, a_stack: torch.Tensor, segments: Segments, lora_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """x [N, in] (any dtype), a_stack [L, R, in] -> t [N, R] float32: ``A_l x[n]`` for each row n whose slot s
    has ``lora_ids[s] = l`` (default: slot s is adapter s), zeros for the other rows."""
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"x must be [N, in] and a_stack [L, R, in], got {tuple(x.shape)} and {tuple(a_stack.shape)}")
    num_rows, num_in = x.shape
    num_loras, rank, _ = a_stack.shape
    lora_ids = _lora_ids(lora_ids, segments, num_loras)
    t = torch.zeros(num_rows, rank, dtype=torch.float32, device=x.device)  # rows without an adapter stay 0
    if num_rows == 0 or lora_ids.numel() == 0:
        return t
    grid = (triton.cdiv(num_rows, _BLOCK_M), lora_ids.numel())
    _shrink_kernel[grid](
        x, a_stack, t, segments.rows, segments.counts, segments.starts, lora_ids,
        num_in, rank,
        x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1), a_stack.stride(2), t.stride(0), t.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_R=_block(rank), BLOCK_K=_BLOCK_K,
        DOT_FP32=a_stack.dtype == torch.float32 or _INTERPRETED,
    )  # fmt: skip
    return t


def lora_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    scalings: torch.Tensor,
    segments: Segments,
    lora_ids: torch.Tensor | None = None,
) -> None:
    """y [N, out] += ``scalings[l] * B_l t[n]`` in place, for each row n whose slot s has ``lora_ids[s] = l``:
    t [N, R] float32 (``lora_shrink``'s), b_stack [L, out, R], scalings [L] float32 on y's device."""
    if y.dim() != 2 or t.shape != (y.shape[0], b_stack.shape[2]) or b_stack.shape[1] != y.shape[1]:
        raise ValueError(f"y must be [N, out], t [N, R], b_stack [L, out, R], got {tuple(y.shape)}, "
                         f"{tuple(t.shape)}, {tuple(b_stack.shape)}")  # fmt: skip
    if scalings.numel() != b_stack.shape[0]:
        raise ValueError(f"scalings has {scalings.numel()} entries for {b_stack.shape[0]} adapters")
    num_rows, num_out = y.shape
    num_loras, _, rank = b_stack.shape
    lora_ids = _lora_ids(lora_ids, segments, num_loras)
    if num_rows == 0 or lora_ids.numel() == 0:
        return
    grid = (triton.cdiv(num_rows, _BLOCK_M), triton.cdiv(num_out, _BLOCK_N), lora_ids.numel())
    _expand_kernel[grid](
        y, t, b_stack, scalings.float(), segments.rows, segments.counts, segments.starts, lora_ids,
        num_out, rank,
        y.stride(0), y.stride(1), t.stride(0), t.stride(1), b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=_block(rank),
        DOT_FP32=b_stack.dtype == torch.float32 or _INTERPRETED,
    )  # fmt: skip
