"""Whether weights changed: the one check of every copy the runtime keeps of a model's weights (the
compiled forward's frozen graph, ``fp32_matmuls``' float32 copies, ``packed_linear``'s packed copies),
and of what the engine keeps of their values (``WeightsWatch``: the prefix cache, CUDA graphs)."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

# torch's version counter of a tensor (a name transformers also uses privately), bumped by every in-place write
version_of = operator.attrgetter("_version")


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> tuple[int, int]:
    """(sum of version counters, sum of data pointers) of ``tensors`` (None skipped): every in-place
    write bumps a tensor's version, a replaced tensor or ``.data`` moves its pointer (a write through
    ``.data`` does neither). ~1 us a tensor, so cheap enough for every step."""
    present = [t for t in tensors if t is not None]
    return sum(map(version_of, present)), sum(t.data_ptr() for t in present)


class WeightsWatch:
    """Notices that a model's weights changed since the last look (the engine looks when it starts work after
    being idle: weights changed under requests in flight are the caller's to announce, ``weights_changed``):
    in place by torch ops (an optimizer step, ``load_state_dict``, ``p.add_`` under ``no_grad``: the version
    counters move) or replaced (``p.data = new`` as DeepSpeed ZeRO-3 gathers do, ``load_state_dict(assign=True)``,
    ``model.to(dtype)``: the data pointers move). A write through ``p.data`` (``p.data.copy_(...)``) moves
    neither, and no check short of reading the values sees it; ``engine.load_weights`` is the way for those.

    The parameters and buffers are read afresh at every look (a module added since, a LoRA adapter, counts):
    ~3 us a tensor, 0.6 ms for 219 tensors, so once per burst of work rather than at every step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._last = self._read()

    def _read(self) -> tuple[int, int]:
        tensors = [*self._model.parameters(), *self._model.buffers()]
        # An inference tensor (accelerate's offloaded weights, a buffer made under inference_mode) has no version
        # counter: it can't be written in place outside inference mode, only replaced, which its pointer shows.
        versions = sum(version_of(t) for t in tensors if not t.is_inference())
        return versions, sum(t.data_ptr() for t in tensors)

    def changed(self) -> tuple[bool, bool]:
        """(whether anything changed since the last look, whether a tensor was replaced); the look is remembered."""
        now, last = self._read(), self._last
        self._last = now
        return now != last, now[1] != last[1]
