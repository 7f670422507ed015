"""Half-precision models' matmuls in float32 on CPUs without half-precision matmul hardware.

On a CPU without AVX-512 BF16 / AMX (an AVX2 EPYC, say), torch has no fast bfloat16 (or float16)
matmul: oneDNN declines it (``torch_private.mkldnn_bf16_supported()`` is False) and
``F.linear`` falls back to a generic loop, 7x slower than the float32 sgemm on the same shapes here
(64 rows of a 512 x 1536 projection: 13.8 ms against 1.9 ms; docs/performance.md, "Against vLLM
on a CPU without AVX-512"). vLLM's CPU build is as slow there.

A bf16 matmul accumulates its exact bf16 x bf16 products in float32 and rounds the sum to bf16 once;
so does ``F.linear(x.float(), w.float()).to(bf16)``: only the order of the float32 sums differs. So
``install`` gives each of the model's plain ``nn.Linear`` layers a float32 copy of its weight (and bias)
and a forward that uses it, taken only where it cannot change what the model means:

- under ``torch.inference_mode`` (the engine's forwards), never while autograd records (training
  through the layer needs the real parameter);
- with the input in the layer's dtype, the parameters still on the CPU and unchanged since the copy
  was made (their version counters and data pointers; a changed one is copied again at the next
  call, eagerly; a write through ``.data`` changes neither, so after one, e.g. a LoRA merge,
  ``uninstall`` the copies). Under torch.compile the layer takes the copies whenever autograd does not
  record (dynamo can't trace the inference-mode check): the engine's compiled forward freezes them
  with the other weights and runs eagerly once any parameter changes
  (``compiled.CompiledModel.stale``); a compile of your own under ``no_grad`` takes them too.

Anything else runs the layer's own forward, and so does every layer that is not a plain ``nn.Linear``
(a subclass with its own forward, a quantized tensor subclass). An engine's copies are its marks
(``marks.py``): on the model only while an engine (or its background compile) runs, kept off it between
engines and put back, the same copies, by the next one (``PagedConfig(fp32_matmuls=False)`` or
``uninstall`` forgets them). They cost 4 bytes per weight, 3x a bf16 model's weights in all, and are made
before the cache is sized from free memory. ``PagedConfig(fp32_matmuls=)`` switches it (``None``: on where the CPU
lacks the hardware, which ``hardware_lacks`` says).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ... import torch_private
from ..model.marks import ModelMarks
from ..model.weights import fingerprint

HALF = (torch.bfloat16, torch.float16)
ATTR = "_hf_paged_fp32"  # where a layer keeps its copies


def hardware_lacks(dtype: torch.dtype | None) -> bool:
    """Whether this CPU has no fast matmul for ``dtype`` (bf16 / fp16; False for any other dtype)."""
    if dtype == torch.bfloat16:
        return not torch_private.mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch_private.mkldnn_fp16_supported()
    return False


@dataclass(slots=True)
class Copies:
    """A layer's float32 weight and bias, and the parameters' identities when they were made."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    made_of: tuple[int, int]  # the parameters' ``fingerprint`` when the copies were made

    @classmethod
    def of(cls, layer: nn.Linear) -> Copies:
        with torch.no_grad():
            bias = None if layer.bias is None else layer.bias.detach().float()
            return cls(layer.weight.detach().float(), bias, fingerprint((layer.weight, layer.bias)))

    def current(self, layer: nn.Linear) -> bool:
        return self.made_of == fingerprint((layer.weight, layer.bias))


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``self``'s forward, through its float32 copies where that cannot change the result's meaning
    (the module's docstring); ``x`` [..., in_features] -> [..., out_features] in x's dtype."""
    copies: Copies = getattr(self, ATTR)
    if x.dtype != self.weight.dtype or self.weight.device.type != "cpu":  # the layer's own (and its errors)
        return nn.Linear.forward(self, x)
    if torch.compiler.is_compiling():  # dynamo can't trace the inference-mode check; grad mode it can
        if torch.is_grad_enabled():
            return nn.Linear.forward(self, x)
    elif not torch.is_inference_mode_enabled():
        return nn.Linear.forward(self, x)
    elif not copies.current(self):  # a changed weight or bias: copy it again
        copies = Copies.of(self)
        setattr(self, ATTR, copies)
    return F.linear(x.float(), copies.weight, copies.bias).to(x.dtype)


def plain_linear(layer: nn.Module, dtypes: tuple[torch.dtype, ...] = HALF) -> bool:
    """An ``nn.Linear`` whose forward is nn.Linear's (not a subclass's own: a BitNet layer quantizes its
    input) on plain CPU tensors of one of ``dtypes`` (not a quantized tensor subclass). ``packed_linear``
    takes the same layers."""
    if not isinstance(layer, nn.Linear) or type(layer).forward is not nn.Linear.forward:
        return False
    tensors = [t for t in (layer.weight, layer.bias) if t is not None]
    return (layer.weight.dtype in dtypes and layer.weight.device.type == "cpu"
            and all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors))  # fmt: skip


def install(model: nn.Module, marks: ModelMarks | None = None) -> int:
    """Give every plain half-precision CPU ``nn.Linear`` of ``model`` its float32 copies and forward
    (idempotent); returns how many layers have them. With ``marks`` (an engine's: ``marks.py``) they are
    recorded there, on the model only while the marks are open, and a layer recorded before keeps its copies."""
    count = 0
    for layer in model.modules():
        if ATTR not in layer.__dict__ and (marks is None or marks.get(layer, ATTR) is None):
            if not plain_linear(layer) or "forward" in layer.__dict__:  # "forward": someone else's (accelerate's hooks)
                continue
            # an instance attribute (other models keep theirs); a partial, unlike a bound method, pickles
            forward = functools.partial(_forward, layer)
            if marks is None:
                setattr(layer, ATTR, Copies.of(layer))
                layer.forward = forward
            else:
                marks.put(layer, ATTR, Copies.of(layer))
                marks.put(layer, "forward", forward)
        count += 1
    return count


def uninstall(model: nn.Module, marks: ModelMarks | None = None) -> int:
    """Remove the float32 copies and forwards ``install`` gave ``model``'s layers (their memory goes
    back; ``marks``: forget those recorded there too); returns how many layers had them."""
    count = 0
    if marks is not None:
        for layer in marks.modules_with(ATTR):
            marks.forget(layer, (ATTR, "forward"))
            count += 1
    for layer in model.modules():
        if ATTR in layer.__dict__:
            del layer.__dict__[ATTR]
            layer.__dict__.pop("forward", None)
            count += 1
    return count


def installed(model: nn.Module) -> int:
    """How many of ``model``'s layers have float32 copies."""
    return sum(ATTR in layer.__dict__ for layer in model.modules())
