"""One choice's text as its tokens arrive: incremental decoding and OpenAI's stop sequences.

OpenAI semantics, which differ from transformers' ``stop_strings``: the text ends *before* the first
stop sequence, which is not returned. While streaming, text that could still become a stop
sequence (or an incomplete UTF-8 character) is held back until the next tokens decide it.
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

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.stop = stop
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
        cut = self._matcher.feed(full[fed:decided]) if decided > fed else None
        if cut is not None:
            full, self.stopped = full[:cut], True
        elif not final:
            full = full[: decided - self._matcher.num_partial]
        self.text = full
        delta = full[self.num_sent :]
        self.num_sent = max(self.num_sent, len(full))
        return delta
