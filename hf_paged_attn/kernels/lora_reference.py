"""The float64 reference of the LoRA kernels (``lora_triton``): one row at a time, explicit casts, never
on the hot path. The kernels are tested against it (``tests/kernels/test_lora_triton.py``,
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
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float64)
    for row, lora in enumerate(token_lora.tolist()):
        if lora < 0:
            continue
        a = a_stack[lora].cpu()  # [R, in]
        out[row] = a.double() @ x[row].cpu().to(a.dtype).double()
    return out


def lora_expand_reference(
    y: torch.Tensor, t: torch.Tensor, b_stack: torch.Tensor, scalings: torch.Tensor, token_lora: torch.Tensor
) -> torch.Tensor:
    """y [N, out], t [N, R] (the shrink's float32 result), b_stack [L, out, R], scalings [L],
    token_lora [N] -> [N, out] float64: ``y + scaling_l * B_l t`` on each row under adapter l, y elsewhere."""
    out = y.cpu().double().clone()
    for row, lora in enumerate(token_lora.tolist()):
        if lora < 0:
            continue
        b = b_stack[lora].cpu()  # [out, R]
        out[row] += float(scalings[lora]) * (b.double() @ t[row].cpu().to(b.dtype).double())
    return out
