"""Half-precision models' matmuls in float32 on CPUs without half-precision matmul hardware.

On a CPU without AVX-512 BF16 / AMX (an AVX2 EPYC, say), torch has no fast bfloat16 (or float16)
matmul: oneDNN declines it (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False) and
``F.linear`` falls back to a generic loop, 7x slower than the float32 sgemm on the same shapes here
(64 rows of a 512 x 1536 projection: 13.8 ms against 1.9 ms; benchmarks/README.md, "bf16 on a CPU
without bf16 matmuls"). vLLM's CPU build is as slow there.

A bf16 matmul accumulates its exact bf16 x bf16 products in float32 and rounds the sum to bf16 once;
so does ``F.linear(x.float(), w.float()).to(bf16)``: only the order of the float32 sums differs. So
``install`` gives each of the model's ``nn.Linear`` layers a float32 copy of its weight (and bias)
and a forward that uses it, taken only where it cannot change what the model means:

- under ``torch.inference_mode`` (the engine's forwards), never while autograd records (training
  through the layer needs the real parameter);
- with the parameter still on the CPU and unchanged since the copy was made (its version counter
  and data pointer; a changed one is copied again at the next call, eagerly). The engine's compiled
  forward skips those checks (``IN_ENGINE_GRAPH``): it freezes the copies with the other weights and
  runs eagerly once any parameter changes (``compiled.CompiledModel.stale``).

Anything else runs the layer's own forward. The copies cost 4 bytes per weight (2x a bf16 model's
weights); they are made before the cache is sized from free memory. ``PagedConfig(fp32_matmuls=)``
switches it (``None``: on where the CPU lacks the hardware, which ``hardware_lacks`` says).
"""

from __future__ import annotations

import operator
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)
ATTR = "_hf_paged_fp32"  # where a layer keeps its copies
_VERSION = operator.attrgetter("_version")  # torch's version counter (bumped by every in-place write)


def hardware_lacks(dtype: torch.dtype | None) -> bool:
    """Whether this CPU has no fast matmul for ``dtype`` (bf16 / fp16; False for any other dtype)."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


@dataclass(slots=True)
class Copies:
    """A layer's float32 weight and bias, and the parameter's identity when they were made."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    version: int
    pointer: int

    @classmethod
    def of(cls, layer: nn.Linear) -> Copies:
        with torch.no_grad():
            bias = None if layer.bias is None else layer.bias.detach().float()
            return cls(layer.weight.detach().float(), bias, _VERSION(layer.weight), layer.weight.data_ptr())

    def current(self, layer: nn.Linear) -> bool:
        return _VERSION(layer.weight) == self.version and layer.weight.data_ptr() == self.pointer


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``self``'s forward, through its float32 copies where that cannot change the result's meaning
    (the module's docstring); ``x`` [..., in_features] -> [..., out_features] in x's dtype."""
    copies: Copies = getattr(self, ATTR)
    if torch.compiler.is_compiling():  # dynamo can't trace the inference-mode check: ask who compiles
        if not IN_ENGINE_GRAPH:
            return type(self).forward(self, x)
    elif not torch.is_inference_mode_enabled() or self.weight.device.type != "cpu":
        return type(self).forward(self, x)
    elif not copies.current(self):  # a changed weight: copy it again
        copies = Copies.of(self)
        setattr(self, ATTR, copies)
    return F.linear(x.float(), copies.weight, copies.bias).to(x.dtype)


# True while the engine's compiled forward (``compiled.run_graph``, always in inference mode) runs: a
# graph dynamo traces then takes the copies (frozen with the other weights); any other compile of the
# model (a user's own, perhaps for training) the layers' own forwards.
IN_ENGINE_GRAPH = False


def install(model: nn.Module) -> int:
    """Give every half-precision CPU ``nn.Linear`` of ``model`` its float32 copies and forward
    (idempotent); returns how many layers have them."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, nn.Linear) or layer.weight.dtype not in HALF or layer.weight.device.type != "cpu":
            continue
        if "forward" in layer.__dict__ and ATTR not in layer.__dict__:  # someone else's forward (accelerate's hooks)
            continue
        if ATTR not in layer.__dict__:
            setattr(layer, ATTR, Copies.of(layer))
            layer.forward = types.MethodType(_forward, layer)  # an instance attribute: other models keep theirs
        count += 1
    return count


def installed(model: nn.Module) -> int:
    """How many of ``model``'s layers have float32 copies."""
    return sum(ATTR in layer.__dict__ for layer in model.modules())
