"""LoRA adapters in the compiled forward: every row's adapter is an input of the graph.

The eager router (``lora.py``) runs one matmul pair per adapter present, on that adapter's rows; a graph
can't, because which rows those are changes every step, and a graph that froze one step's row groups would
give the next step's rows the wrong adapter. In the compiled forward (``compiled.py``) the step's rows carry
their adapter as ``adapter_index`` [1, N] int64, a graph input beside ``input_ids`` (dynamic in N like it):
0 for the base model and for padding rows, ``slots[name]`` for adapter ``name``. Each LoRA layer runs every
adapter it holds on every row and keeps each delta on that adapter's rows only (``torch.where``), so one
graph serves every mix of adapters in a step: S adapters cost S matmul pairs on all N rows where the eager
loop costs one pair per row, dense and of one shape.

Each row's sum is PEFT's: ``result + scaling * B(A(x))`` for its adapter's delta (x cast to the adapter's
dtype, the delta cast back, as PEFT's ``_mixed_batch_forward``), ``result + 0`` for every other adapter.

What the graph does hold fixed is the model's adapter structure (``signature``): which adapters each LoRA
layer holds, their slots and their ``scaling``. A change to it (``load_adapter``, ``unload_adapter``,
``set_scale``, LoRA layers on new modules) retires the graph: ``compiled.CompiledExecutor`` makes a new one
for the new structure (eager steps until it is compiled, as at start).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ...attention.step import StepMetadata

Signature = tuple[tuple[tuple[str, float], ...], ...]  # per LoRA layer: (adapter, scaling) pairs


def adapter_slots(adapters: Iterable[str]) -> dict[str, int]:
    """Each adapter's number in ``adapter_index`` (1, 2, ... in name order; 0 is the base model)."""
    return {name: slot for slot, name in enumerate(sorted(adapters), start=1)}


def signature(layers: Sequence[torch.nn.Module]) -> Signature:
    """What a compiled graph of these LoRA layers froze: each layer's adapters and scalings, in order."""
    return tuple(tuple((name, float(layer.scaling[name])) for name in sorted(layer.lora_A.keys())) for layer in layers)


def row_index(step: StepMetadata, slots: dict[str, int], num_rows: int) -> torch.Tensor:
    """[1, num_rows] int64: each of ``step``'s packed rows' adapter slot (its request's; a draft row is its
    request's too), 0 for the base model and for padding rows past ``step.num_tokens``."""
    device = step.input_ids.device
    index = torch.zeros(1, num_rows, dtype=torch.long, device=device)
    if not step.adapters:
        return index
    per_request = torch.tensor([0 if a is None else slots[a] for a in step.adapters], dtype=torch.long)
    q_lens = step.cu_seq_lens_q.diff().cpu()  # [B]
    rows = per_request.repeat_interleave(q_lens)  # [N]
    index[0, : rows.numel()] = rows.to(device)
    return index


def masked_forward(
    layer: torch.nn.Module, slots: dict[str, int], index: torch.Tensor, x: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """A PEFT LoRA ``layer``'s forward as the graph traces it: the base layer on ``x`` [..., in], plus each
    adapter's ``scaling * B(A(x))`` on the rows whose ``index`` [...] (x's leading dims) is its slot."""
    kwargs.pop("adapter_names", None)
    result = layer.base_layer(x, *args, **kwargs)  # [..., out]
    index = index.reshape(x.shape[:-1]).unsqueeze(-1)  # [..., 1]
    for name in sorted(layer.lora_A.keys()):
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        delta = lora_b(lora_a(x.to(lora_a.weight.dtype))) * layer.scaling[name]  # [..., out]
        result = result + torch.where(index == slots[name], delta.to(result.dtype), 0.0)
    return result
