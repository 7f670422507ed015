"""Whether weights changed: the one check of every copy the runtime keeps of a model's weights (the
compiled forward's frozen graph, ``fp32_matmuls``' float32 copies, ``packed_linear``'s packed copies)."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

_VERSION = operator.attrgetter("_version")  # torch's version counter (a name transformers also uses privately)


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> tuple[int, int]:
    """(sum of version counters, sum of data pointers) of ``tensors`` (None skipped): every in-place
    write bumps a tensor's version, a replaced tensor or ``.data`` moves its pointer (a write through
    ``.data`` does neither). ~1 us a tensor, so cheap enough for every step."""
    present = [t for t in tensors if t is not None]
    return sum(map(_VERSION, present)), sum(t.data_ptr() for t in present)
