"""The eager LoRA router's CUDA path: every adapter of a step in one Triton kernel pair per LoRA layer.

The torch path (``lora.py``) runs one matmul pair per adapter present, with a gather and an ``index_add_``
where an adapter's rows are not one run. On CUDA with triton installed (``use_triton``), the router hands a
layer to ``LoraKernels.add`` instead: Punica's segmented pair (``kernels/lora_triton.py``) over the step's
rows grouped by adapter, one shrink and one expand whatever the mix.

What lives longer than a step: each LoRA layer's *stacks*, its adapters' A [L, R, in] and B [L, out, R]
weights padded to their largest rank (copies, so they cost the adapters' memory once more), their scalings
and the map from the step's slots to them. They are rebuilt when the key changes: the model's adapters
(a load or unload renumbers the slots), the layer's adapters and ``scaling`` (``set_scale``), or their
weights (``weights.fingerprint``: an in-place write moves a version counter, a replaced tensor its
pointer; a write through ``.data`` moves neither, as everywhere else in the runtime). What lives one step:
the rows grouped by slot (``lora_triton.lora_segments``), made at the step's first LoRA layer and shared
by all of them.

Not on this path (the torch loop runs them): a tensor-parallel layer (its ``lora_A`` / ``lora_B`` forwards
hold the collectives), PEFT's ``lora_bias`` (a bias on B, which the kernels do not add), and adapter
weights on another device than the rows (offloaded).
"""

from __future__ import annotations

import functools
import importlib.util
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from .weights import fingerprint

Rows = slice | torch.Tensor  # as lora.Rows: one adapter's rows of the packed step


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """Whether the eager router runs LoRA through the Triton kernels on ``device``: CUDA of compute capability
    8.0+ (bf16 dots) with triton installed. The one switch: a test replaces it to run the kernels on CPU
    tensors under ``TRITON_INTERPRET=1``."""
    if device.type != "cuda" or not _triton_installed():
        return False
    return _capability(device.index) >= (8, 0)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # asked for every LoRA layer at every step: once is enough


def suits(layer: torch.nn.Module, device: torch.device) -> bool:
    """Whether the kernels compute what ``layer``'s adapters do on rows on ``device``: not sharded, no bias
    on B, every adapter's weights on ``device`` (not offloaded)."""
    if getattr(layer.get_base_layer(), "_hf_device_mesh", None) is not None:
        return False
    lora_b = [layer.lora_B[name] for name in layer.lora_B.keys()]
    weights = [layer.lora_A[name].weight for name in layer.lora_A.keys()] + [b.weight for b in lora_b]
    return all(b.bias is None for b in lora_b) and all(w.device == device for w in weights)


def _ops() -> ModuleType:
    from ...kernels import lora_triton  # imports triton: only once a kernel runs

    return lora_triton


@dataclass(frozen=True)
class Stacks:
    """One LoRA layer's adapters, ready for the kernels, and the key they were built for."""

    key: tuple
    a: torch.Tensor  # [L, R, in]
    b: torch.Tensor  # [L, out, R]
    scalings: torch.Tensor  # [L] float32
    lora_ids: torch.Tensor  # [S] int32: each slot's index in a and b, -1 where the layer lacks the adapter


def _key(layer: torch.nn.Module, slots: dict[str, int]) -> tuple:
    names = sorted(layer.lora_A.keys())
    weights = [w for n in names for w in (layer.lora_A[n].weight, layer.lora_B[n].weight)]
    return tuple(slots.items()), tuple((n, float(layer.scaling[n])) for n in names), fingerprint(weights)


def build_stacks(layer: torch.nn.Module, slots: dict[str, int]) -> Stacks:
    """``layer``'s stacks for the step's ``slots`` (adapter -> slot), in the layer's adapters' name order."""
    ops = _ops()
    names = sorted(layer.lora_A.keys())
    a = [layer.lora_A[n].weight.detach() for n in names]  # [r_l, in] each
    b = [layer.lora_B[n].weight.detach() for n in names]  # [out, r_l] each
    # PEFT casts x to each adapter's dtype; adapters of one layer in two dtypes share the wider one
    dtype = functools.reduce(torch.promote_types, (w.dtype for w in a + b))
    device = a[0].device
    index = {n: i for i, n in enumerate(names)}
    lora_ids = [index.get(name, -1) for name in slots]  # slots is in slot order
    return Stacks(
        key=_key(layer, slots),
        a=ops.stack_padded(a, 0, dtype),
        b=ops.stack_padded(b, 1, dtype),
        scalings=torch.tensor([float(layer.scaling[n]) for n in names], dtype=torch.float32, device=device),
        lora_ids=torch.tensor(lora_ids, dtype=torch.int32, device=device),
    )


class LoraKernels:
    """The router's state for the Triton path: each layer's stacks, and the running step's slots and row
    grouping, made at the step's first LoRA layer on this path (a step on the torch loop pays nothing).
    ``adapters``: every adapter the model holds now (the slots are their name order)."""

    def __init__(self, adapters: Callable[[], Iterable[str]]) -> None:
        self._adapters = adapters
        self._stacks: weakref.WeakKeyDictionary[torch.nn.Module, Stacks] = weakref.WeakKeyDictionary()
        self._slots: dict[str, int] | None = None
        self._segments = None  # lora_triton.Segments of the running step

    def new_step(self) -> None:
        """Forget the last step's slots and grouping."""
        self._slots = None
        self._segments = None

    def slots(self) -> dict[str, int]:
        """Each adapter's slot in the running step (0, 1, ... in name order)."""
        if self._slots is None:
            self._slots = {name: slot for slot, name in enumerate(sorted(self._adapters()))}
        return self._slots

    def stacks(self, layer: torch.nn.Module) -> Stacks:
        """``layer``'s stacks, rebuilt if its key changed since they were built."""
        slots = self.slots()
        found = self._stacks.get(layer)
        if found is None or found.key != _key(layer, slots):
            found = self._stacks[layer] = build_stacks(layer, slots)
        return found

    def segments(self, groups: Sequence[tuple[str, Rows]], num_rows: int, device: torch.device):
        """The step's rows grouped by slot (``lora_triton.Segments``), made once per step."""
        if self._segments is None:
            slots = self.slots()
            token_slot = torch.full((num_rows,), -1, dtype=torch.int32, device=device)  # [N]: -1, the base model
            for adapter, rows in groups:
                token_slot[rows] = slots[adapter]
            self._segments = _ops().lora_segments(token_slot, len(slots))
        return self._segments

    def add(
        self, layer: torch.nn.Module, groups: Sequence[tuple[str, Rows]], x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out`` [N, out] += each row's ``scaling * B(A(x))`` under its adapter, in place; x [N, in]."""
        if not any(adapter in layer.lora_A for adapter, _ in groups):
            return  # no row of this step runs an adapter that targets this module
        ops = _ops()
        stacks = self.stacks(layer)
        segments = self.segments(groups, x.shape[0], x.device)
        t = ops.lora_shrink(x, stacks.a, segments, stacks.lora_ids)  # [N, R] float32
        ops.lora_expand(out, t, stacks.b, stacks.scalings, segments, stacks.lora_ids)
