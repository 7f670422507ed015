"""Stop sequences found in text that arrives a piece at a time, in bounded time and memory.

One Knuth-Morris-Pratt automaton per stop sequence: each character fed costs O(1) amortized per
sequence, and the memory is one int per character of each sequence (the failure table, cached per
distinct sequence). This replaces transformers' ``StopStringCriteria`` on the server's side, which
builds a (vocabulary x sequence length) table per distinct stop string: about 517 MB and 2.5 s for
one sequence of 32,768 characters, under the engine's lock.

The automaton's state also says how much of the text's end could still become a stop sequence (the
longest suffix that is a proper prefix of one), which is the text a stream must hold back.
"""

from __future__ import annotations

from array import array
from functools import lru_cache

NUM_CACHED_TABLES = 64  # distinct stop sequences whose tables are kept (<= 64 x 4 bytes x max length)


@lru_cache(maxsize=NUM_CACHED_TABLES)
def failure_table(pattern: str) -> array:
    """``table[i]``: the length of the longest proper prefix of ``pattern[: i + 1]`` that is also its suffix."""
    table = array("I", [0]) * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


class StopMatcher:
    """The first place any of ``stops`` (non-empty strings) ends in the text fed so far.

    ``feed(text)`` returns the start index (in everything fed so far) of the first stop sequence to
    be completed, or None; of several completed by the same character, the longest (earliest start)
    wins. The result does not depend on how the text is split into pieces. Feed nothing after a hit.
    ``feed(text, find=False)`` reads text in which no stop sequence may *end* (vLLM's ``min_tokens``:
    the text of the first tokens): its hits are passed over, but one that ends later may begin there.
    """

    def __init__(self, stops: list[str]) -> None:
        assert all(stops), "stop sequences must be non-empty"
        self.stops = list(stops)
        self._tables = [failure_table(s) for s in self.stops]
        self._states = [0] * len(self.stops)  # characters of each sequence matched at the end of the text
        self.num_fed = 0

    @property
    def num_partial(self) -> int:
        """Characters at the end of the text fed that could still become a stop sequence."""
        return max(self._states, default=0)

    def feed(self, text: str, find: bool = True) -> int | None:
        if not self.stops:
            self.num_fed += len(text)
            return None
        stops, tables, states = self.stops, self._tables, self._states
        for offset, char in enumerate(text):
            hit = None
            for k, stop in enumerate(stops):
                q = states[k]
                while q and stop[q] != char:
                    q = tables[k][q - 1]
                if stop[q] == char:
                    q += 1
                if q == len(stop):
                    start = self.num_fed + offset + 1 - q
                    hit = start if hit is None else min(hit, start)
                    q = tables[k][q - 1]
                states[k] = q
            if hit is not None and find:
                self.num_fed += offset + 1
                return hit
        self.num_fed += len(text)
        return None
