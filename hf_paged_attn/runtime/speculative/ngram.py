"""Prompt lookup (n-gram) proposals, with the candidate choice of transformers'
``PromptLookupCandidateGenerator`` (5.24): for ``n`` from ``max_matching_ngram_size`` down to 1, the
*first* (leftmost) earlier occurrence of the sequence's last ``n`` tokens; its continuation, at most
``k`` tokens and never past the sequence's end, cut before the first EOS. A size whose only
occurrence is the suffix itself falls through to the next smaller size; a continuation that the
EOS cut empties proposes nothing (transformers stops there too).

Transformers scans the whole sequence at every step. Here each request keeps an index of the first
occurrence of every n-gram (n <= max size) of its tokens, extended by the tokens it gained since
the last step: a proposal costs ``max_matching_ngram_size`` dict lookups whatever the sequence's
length, so the proposals of a whole batch are a few microseconds per request on the host.

Not carried over: transformers also drops candidates its logits processors forbid (it runs them on
constant logits). Only requests whose processors never read the ids speculate here (temperature,
top-k, top-p, ...), and on constant logits those forbid nothing but ties (top-p on a uniform row
keeps an arbitrary share of it), so the check would only cut candidates at random.
"""

from __future__ import annotations

from collections.abc import Collection

from ...core.request import Request


class NgramIndex:
    """The first position of every n-gram (``1 <= n <= max_n``) of one request's tokens."""

    __slots__ = ("max_n", "tokens", "first")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []  # the request's tokens indexed so far (prompt, then output)
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> start of its first occurrence

    def extend(self, request: Request) -> None:
        """Index the tokens ``request`` has gained since the last call (its tokens only grow)."""
        tokens, first, max_n = self.tokens, self.first, self.max_n
        for token in request.token_slice(len(tokens), request.num_tokens - len(tokens)):
            tokens.append(token)
            end = len(tokens)
            for n in range(1, min(max_n, end) + 1):
                first.setdefault(tuple(tokens[end - n :]), end - n)

    def propose(self, k: int, eos_token_ids: Collection[int] = ()) -> list[int]:
        """Up to ``k`` tokens that followed the first earlier occurrence of the longest matching suffix."""
        tokens, length = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), 0, -1):
            start = self.first.get(tuple(tokens[length - n :]))
            if start is None or start + n >= length:  # only the suffix itself
                continue
            chosen = tokens[start + n : min(start + n + k, length)]
            if eos_token_ids:
                cut = next((i for i, t in enumerate(chosen) if t in eos_token_ids), len(chosen))
                chosen = chosen[:cut]
            return chosen
        return []
