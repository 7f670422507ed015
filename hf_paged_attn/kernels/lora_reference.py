"""The float64 reference of the LoRA kernels (``lora_triton``): one adapter's rows at a time, explicit
casts, never on the hot path. The kernels are tested against it (``tests/kernels/test_lora_triton.py``,
``scripts/gpu_check/checks/lora.py``).

The casts are those the kernels (and PEFT's ``lora_B(lora_A(x.to(w.dtype)))``) make: a row is cast to the
A stack's dtype before the shrink and the shrink's result to the B stack's dtype before the expand; what
the reference leaves out is the rounding of the sums, which is what a test's tolerance accounts for.
"""

from __future__ import annotations

import torch


def lora_shrink_reference(x: torch.Tensor, a_stack: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """x [N, in], a_stack [L, R, in], token_lora [N] (the stack index of each row's adapter, -1: none)
    -> [N, R] float64: ``A_l x`` for each row under adapter l, zeros for a row with none."""
    x, a_stack, token_lora = x.cpu(), a_stack.cpu(), token_lora.cpu()
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float64)
    for lora in range(a_stack.shape[0]):
        rows = token_lora == lora  # [N] bool
        a = a_stack[lora]  # [R, in]
        out[rows] = x[rows].to(a.dtype).double() @ a.double().T  # [rows, R]
    return out


def lora_expand_reference(
    y: torch.Tensor, t: torch.Tensor, b_stack: torch.Tensor, scalings: torch.Tensor, token_lora: torch.Tensor
) -> torch.Tensor:
    """y [N, out], t [N, R] (the shrink's float32 result), b_stack [L, out, R], scalings [L],
    token_lora [N] -> [N, out] float64: ``y + scaling_l * B_l t`` on each row under adapter l, y elsewhere."""
    t, b_stack, token_lora = t.cpu(), b_stack.cpu(), token_lora.cpu()
    out = y.cpu().double().clone()
    for lora in range(b_stack.shape[0]):
        rows = token_lora == lora  # [N] bool
        b = b_stack[lora]  # [out, R]
        out[rows] += float(scalings[lora]) * (t[rows].to(b.dtype).double() @ b.double().T)  # [rows, out]
    return out


# Rounding error bounds of the kernels' arithmetic, elementwise, against the references above. A float32 sum of
# k products is within gamma_k = k u / (1 - k u) (u = 2^-24) of the exact one, relative to the sum of the
# products' magnitudes (exact products: half-precision inputs multiply exactly in float32); every later rounding
# adds its unit roundoff of the value.
_U32 = 2.0**-24


def _gamma(k: int) -> float:
    return k * _U32 / (1 - k * _U32)


def lora_shrink_bound(x: torch.Tensor, a_stack: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """[N, R] float64: how far ``lora_shrink`` may be from ``lora_shrink_reference``: gamma_in |A_l| |x|."""
    return _gamma(x.shape[1]) * lora_shrink_reference(x.abs(), a_stack.abs(), token_lora)


def lora_expand_bound(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    scalings: torch.Tensor,
    token_lora: torch.Tensor,
    want: torch.Tensor,
    cast_roundoff: float | None = None,
) -> torch.Tensor:
    """[N, out] float64: how far ``lora_expand`` may be from ``want`` (``lora_expand_reference``'s): the dot and
    its scaling (gamma_{R+1} |s| |B_l| |t|), adding y in float32 (u32), the cast to y's dtype (``cast_roundoff``,
    default its unit roundoff: round to nearest), each relative to the value; plus the dtype's smallest normal
    for a result that underflows."""
    cast_roundoff = torch.finfo(y.dtype).eps / 2 if cast_roundoff is None else cast_roundoff
    magnitude = lora_expand_reference(torch.zeros_like(y), t.abs(), b_stack.abs(), scalings.abs(), token_lora)
    dot = _gamma(b_stack.shape[2] + 1) * magnitude
    summed = dot + _U32 * (want.abs() + dot)
    return summed + cast_roundoff * (want.abs() + summed) + torch.finfo(y.dtype).tiny
