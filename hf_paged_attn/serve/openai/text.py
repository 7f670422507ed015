"""One choice's text as its tokens arrive: incremental decoding and OpenAI's stop sequences.

OpenAI semantics, which differ from transformers' ``stop_strings``: the text ends *before* the first
stop sequence, which is not returned. While streaming, text that could still become a stop
sequence (or an incomplete UTF-8 character) is held back until the next tokens decide it. With
``min_tokens`` (vLLM's), no stop sequence may end in the text of the first ``min_tokens`` tokens, as
in vLLM (one may begin there and end later).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .stops import StopMatcher

REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


def make_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, calling the Rust tokenizer directly
    where that is all ``decode`` does: it skips a per-id Python conversion that costs more than
    the decoding itself, once per token per stream."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - another transformers layout
        TokenizersBackend = None  # noqa: N806
    backend = getattr(tokenizer, "_tokenizer", None)
    plain = (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    )
    if plain and backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    """Decode a growing list of token ids into text deltas, stopping at the first stop sequence.

    Text is decided once it is followed by no incomplete character: the stop matcher sees each
    decided character once. What could still turn into a stop sequence is held back until the next
    tokens decide it (or the last output, which sends everything).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], min_tokens: int = 0) -> None:
        self.decode = decode
        self.stop = stop
        self.min_tokens = min_tokens
        self._num_quiet: int | None = None if stop and min_tokens else 0  # see _quiet
        self.ids: list[int] = []
        self.text = ""  # everything decided so far (sent or ready to send)
        self.num_sent = 0
        self.stopped = False  # a stop sequence was found: no more text, whatever arrives
        self._matcher = StopMatcher(stop)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Take the next tokens; return the text that is now safe to send (maybe "")."""
        if self.stopped:
            return ""
        self.ids += new_ids
        full = self.decode(self.ids)
        decided = len(full) if final else len(full.rstrip(REPLACEMENT))
        fed = self._matcher.num_fed
        quiet = min(self._quiet(full), decided)
        if quiet > fed:  # no stop sequence may end here
            self._matcher.feed(full[fed:quiet], find=False)
            fed = quiet
        cut = self._matcher.feed(full[fed:decided]) if decided > fed else None
        if cut is not None:
            full, self.stopped = full[:cut], True
        elif not final:
            full = full[: decided - self._matcher.num_partial]
        self.text = full
        delta = full[self.num_sent :]
        self.num_sent = max(self.num_sent, len(full))
        return delta

    def _quiet(self, full: str) -> int:
        """Characters of ``full`` (the text of every id so far) in which no stop sequence may end:
        those of the first ``min_tokens`` tokens (all of it until there are that many)."""
        if self._num_quiet is not None:
            return self._num_quiet
        if len(self.ids) < self.min_tokens:
            return len(full)
        # A character the min_tokens-th token leaves incomplete belongs to the next one.
        self._num_quiet = len(self.decode(self.ids[: self.min_tokens]).rstrip(REPLACEMENT))
        return self._num_quiet
