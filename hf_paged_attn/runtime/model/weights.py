"""Whether weights changed: the one check of every copy the runtime keeps of a model's weights (the
compiled forward's frozen graph, ``fp32_matmuls``' float32 copies, ``packed_linear``'s packed copies)."""

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
