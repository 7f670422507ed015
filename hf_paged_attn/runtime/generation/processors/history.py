"""Row state for batched processors: each tracked request's ids on the device (``TokenHistory``),
read for a step as ``Rows``."""


from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


# ------------------------------------------------------------------------------------------ row state
@dataclass(slots=True)
class Rows:
    """The ids of one step's stacked rows, as processors read them.

    ``ids`` [R, L] int64 on the scores' device, ``L`` the longest row; row ``i`` holds its left
    padding, prompt and generated tokens in ``ids[i, :lengths[i]]`` and ``-1`` after.
    ``lengths``/``starts`` [R] int64 on the host (numpy): each row's length, and where its
    generated tokens begin (padding + prompt length); ``lengths_t``/``starts_t`` the same on the device.
    """

    ids: torch.Tensor
    lengths: np.ndarray
    starts: np.ndarray
    lengths_t: torch.Tensor
    starts_t: torch.Tensor

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_lists(
        cls, rows: Sequence[Sequence[int]], starts: Sequence[int] | None = None, device: torch.device | str = "cpu"
    ) -> Rows:
        """Rows from Python lists (tests, or a caller without a ``TokenHistory``). ``starts``
        defaults to each row's length: no generated tokens."""
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        starts = np.array(starts if starts is not None else lengths, dtype=np.int64)
        ids = torch.full((len(rows), max(int(lengths.max(initial=0)), 1)), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        meta = torch.from_numpy(np.stack([lengths, starts])).to(device)  # [2, R]
        return cls(ids.to(device), lengths, starts, meta[0], meta[1])


class TokenHistory:
    """Each tracked request's token ids, one row of a device buffer, kept up to date in place.

    ``add`` when a request first needs its rows processed (its prompt, after generate's left
    padding), ``append`` each step's sampled tokens (one ``index_put_`` for every row), ``fork`` a
    sibling (``num_return_sequences``: a copy of the parent's row), ``release`` when it finishes or
    fails. Preemption changes nothing: a preempted request keeps its prompt and generated tokens.
    The buffer grows by doubling (rows and width); a released row is reused.
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int = 8, width: int = 64) -> None:
        self.device = torch.device(device)
        self.ids = torch.full((capacity, width), -1, dtype=torch.long, device=self.device)  # [capacity, width]
        self.lengths = np.zeros(capacity, dtype=np.int64)  # each row's length (host: no sync to read it)
        self.starts = np.zeros(capacity, dtype=np.int64)  # where each row's generated tokens begin
        self.slots: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, key: Hashable, ids: Sequence[int], num_prompt: int | None = None) -> None:
        """Track ``key``: ``ids`` = generate's left padding + prompt (+ any tokens it already
        generated); ``num_prompt`` = padding + prompt length, where its generated tokens begin
        (default: all of ``ids``)."""
        if key in self.slots:
            raise ValueError(f"{key!r} is already tracked")
        num_prompt = len(ids) if num_prompt is None else num_prompt
        if not 0 <= num_prompt <= len(ids):
            raise ValueError(f"num_prompt={num_prompt} is outside the {len(ids)} ids")
        if not self._free:
            self._grow_rows()
        self._reserve_width(len(ids))
        slot = self._free.pop()
        row = torch.full((self.ids.shape[1],), -1, dtype=torch.long)
        row[: len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        self.ids[slot] = row.to(self.device)
        self.lengths[slot], self.starts[slot] = len(ids), num_prompt
        self.slots[key] = slot

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Track ``child`` with a copy of ``parent``'s row (a sibling drawn from the same prompt)."""
        if child in self.slots:
            raise ValueError(f"{child!r} is already tracked")
        if not self._free:
            self._grow_rows()
        src, slot = self.slots[parent], self._free.pop()
        self.ids[slot] = self.ids[src]
        self.lengths[slot], self.starts[slot] = self.lengths[src], self.starts[src]
        self.slots[child] = slot

    def release(self, key: Hashable) -> None:
        """Forget ``key`` (finished, aborted, failed); its row is cleared for reuse. Unknown keys are ignored."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.ids[slot].fill_(-1)
            self.lengths[slot] = self.starts[slot] = 0
            self._free.append(slot)

    def append(self, keys: Sequence[Hashable], tokens: Sequence[int] | torch.Tensor) -> None:
        """One new token for each of ``keys`` (distinct): ``tokens[i]`` is ``keys[i]``'s."""
        if not keys:
            return
        slots = self._slots(keys)
        assert len(set(slots.tolist())) == len(slots), "a row appears twice in one append"
        self._reserve_width(int(self.lengths[slots].max()) + 1)
        where = torch.from_numpy(np.stack([slots, self.lengths[slots]])).to(self.device)  # [2, R]: row, column
        values = torch.as_tensor(tokens, dtype=torch.long).to(self.device).view(-1)
        self.ids.index_put_((where[0], where[1]), values)
        self.lengths[slots] += 1

    def rows(self, keys: Sequence[Hashable]) -> Rows:
        """The stacked rows of ``keys``, in that order (what ``run_plans`` reads)."""
        slots = self._slots(keys)
        lengths, starts = self.lengths[slots], self.starts[slots]
        width = max(int(lengths.max(initial=0)), 1)
        meta = torch.from_numpy(np.stack([slots, lengths, starts])).to(self.device)  # [3, R]: one copy to the device
        ids = self.ids[:, :width].index_select(0, meta[0])  # [R, width]
        return Rows(ids, lengths, starts, meta[1], meta[2])

    def row(self, key: Hashable) -> torch.Tensor:
        """``key``'s ids as the ``[1, len]`` batch transformers' processors see for one prompt."""
        slot = self.slots[key]
        return self.ids[slot : slot + 1, : self.lengths[slot]]

    def _slots(self, keys: Sequence[Hashable]) -> np.ndarray:
        return np.fromiter((self.slots[k] for k in keys), dtype=np.int64, count=len(keys))

    def _grow_rows(self) -> None:
        capacity = self.ids.shape[0]
        self.ids = torch.cat([self.ids, torch.full_like(self.ids, -1)])
        self.lengths = np.concatenate([self.lengths, np.zeros(capacity, dtype=np.int64)])
        self.starts = np.concatenate([self.starts, np.zeros(capacity, dtype=np.int64)])
        self._free.extend(range(2 * capacity - 1, capacity - 1, -1))

    def _reserve_width(self, width: int) -> None:
        if width > self.ids.shape[1]:
            new = max(width, 2 * self.ids.shape[1])
            grown = torch.full((self.ids.shape[0], new), -1, dtype=torch.long, device=self.device)
            grown[:, : self.ids.shape[1]] = self.ids
            self.ids = grown


