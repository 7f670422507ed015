"""The batched processors: each equal to transformers' own on the row ``generate`` would see,
run once on a step's stacked rows; ``Opaque`` runs one it does not know per row."""


from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .history import Rows

# Processors that read the scores only, never the ids: transformers' instance runs on stacked rows as is.
ROW_FREE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    LogitNormalization,
    InfNanRemoveLogitsProcessor,
)
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each logit_bias value to [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's (and vLLM's) range for presence and frequency penalties: [-2, 2]



# ------------------------------------------------------------------------------------------ processors
class BatchedProcessor:
    """One processor of a plan, run once on a step's stacked rows.

    ``key``: the settings rows must share to be stacked (type and what the arithmetic depends on);
    what may differ per row (lengths, thresholds) stays on each row's own instance, which
    ``__call__`` receives as ``peers`` (``peers[i]`` is row ``i``'s). ``__call__`` may change
    ``scores`` [R, vocab] in place and returns the processed scores. ``reads_rows``: False when
    ``rows`` is never read (it may then be None).
    """

    __slots__ = ()
    reads_rows: ClassVar[bool] = True

    @property
    def key(self) -> tuple:
        raise NotImplementedError

    def __call__(self, rows: Rows | None, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({settings})"


@lru_cache(maxsize=512)
def _index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small constant index tensor (eos ids, suppressed tokens), made once per device."""
    return torch.tensor(values, dtype=torch.long, device=device)


def _active(mask: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """The rows where the host-side ``mask`` holds, on the device; None when no row does (most steps)."""
    rows = np.flatnonzero(mask)
    return torch.from_numpy(rows).to(device) if rows.size else None


def _in_vocab(tokens: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """``torch.isin(arange(vocab), tokens)`` ignores ids past the vocab; so do we."""
    return tuple(t for t in tokens if 0 <= t < vocab_size)


def _per_row(peers: Sequence[BatchedProcessor], name: str) -> np.ndarray:
    return np.fromiter((getattr(p, name) for p in peers), dtype=np.int64, count=len(peers))


class RepetitionPenalty(BatchedProcessor):
    """``RepetitionPenaltyLogitsProcessor``: each token of the row (after its first ``ignore`` ids:
    ``prompt_ignore_length``, which ``generate`` sets to the left padding) has its score divided by
    ``penalty`` (multiplied where negative), once per distinct token."""

    __slots__ = ("penalty", "ignore")

    def __init__(self, penalty: float, ignore: int = 0) -> None:
        if not isinstance(penalty, float) or not penalty > 0:
            raise ValueError(f"penalty must be a float > 0, got {penalty!r}")
        self.penalty, self.ignore = penalty, int(ignore)

    @property
    def key(self) -> tuple:
        return ("repetition_penalty", self.penalty)  # a per-row penalty tensor could round differently on CUDA

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        vocab_size = scores.shape[-1]
        ids = rows.ids
        ignore = _per_row(peers, "ignore")
        if ignore.any():
            ignore_t = torch.from_numpy(ignore).to(ids.device)
            ids = ids.masked_fill(torch.arange(ids.shape[1], device=ids.device) < ignore_t[:, None], vocab_size)
        # Ids past the row (-1) or the output vocab go to a spare column, dropped at the end (as transformers does)
        ids = torch.where(ids < 0, vocab_size, ids.clamp(max=vocab_size))
        padded = torch.nn.functional.pad(scores, (0, 1))  # [R, vocab + 1]
        score = padded.gather(1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return padded.scatter_(1, ids, score)[:, :vocab_size]


class NoRepeatNGram(BatchedProcessor):
    """``NoRepeatNGramLogitsProcessor``: a token that would complete an n-gram already in the row is -inf."""

    __slots__ = ("ngram_size",)

    def __init__(self, ngram_size: int) -> None:
        if not isinstance(ngram_size, int) or ngram_size <= 0:
            raise ValueError(f"ngram_size must be an int > 0, got {ngram_size!r}")
        self.ngram_size = ngram_size

    @property
    def key(self) -> tuple:
        return ("no_repeat_ngram", self.ngram_size)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        n, ids = self.ngram_size, rows.ids
        if not (rows.lengths >= n).any():  # no row has a complete n-gram yet
            return scores
        vocab_size = scores.shape[-1]
        windows = ids.unfold(1, n, 1)  # [R, L - n + 1, n]
        # Each row's last n - 1 tokens; a window whose first n - 1 match them bans its last token
        tail = (rows.lengths_t[:, None] - (n - 1) + torch.arange(n - 1, device=ids.device)).clamp(min=0)  # [R, n - 1]
        matches = (windows[..., :-1] == ids.gather(1, tail)[:, None, :]).all(dim=-1)  # [R, L - n + 1]
        # A window whose first n - 1 ids are all in the row and match its tail ends inside the row, but
        # for the one starting at the tail itself: it ends past the row (-1), and transformers has no
        # such window. (In a row shorter than n that is the only one that can match.)
        last = windows[..., -1]
        banned = torch.where(matches & (last >= 0), last.clamp(max=vocab_size), vocab_size)
        mask = torch.zeros(scores.shape[0], vocab_size + 1, dtype=torch.bool, device=scores.device)
        mask.scatter_(1, banned, True)
        return scores.masked_fill_(mask[:, :vocab_size], -math.inf)


class MinLength(BatchedProcessor):
    """``MinLengthLogitsProcessor``: EOS is -inf while the row (padding included) is shorter than ``min_length``."""

    __slots__ = ("min_length", "eos")

    def __init__(self, min_length: int, eos: Sequence[int]) -> None:
        self.min_length, self.eos = int(min_length), tuple(int(t) for t in eos)

    @property
    def key(self) -> tuple:
        return ("min_length", self.eos)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        active = _active(rows.lengths < _per_row(peers, "min_length"), scores.device)
        return _mask_tokens(scores, active, self.eos)


class MinNewTokens(BatchedProcessor):
    """``MinNewTokensLengthLogitsProcessor``: EOS is -inf while the row has fewer than
    ``min_new_tokens`` ids past its first ``prompt_length_to_skip``."""

    __slots__ = ("prompt_length_to_skip", "min_new_tokens", "eos")

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos: Sequence[int]) -> None:
        self.prompt_length_to_skip, self.min_new_tokens = int(prompt_length_to_skip), int(min_new_tokens)
        self.eos = tuple(int(t) for t in eos)

    @property
    def key(self) -> tuple:
        return ("min_new_tokens", self.eos)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        num_new = rows.lengths - _per_row(peers, "prompt_length_to_skip")
        active = _active(num_new < _per_row(peers, "min_new_tokens"), scores.device)
        return _mask_tokens(scores, active, self.eos)


def _mask_tokens(scores: torch.Tensor, active: torch.Tensor | None, tokens: tuple[int, ...]) -> torch.Tensor:
    tokens = _in_vocab(tokens, scores.shape[-1])
    if active is not None and tokens:
        scores[active[:, None], _index(tokens, scores.device)[None, :]] = -math.inf
    return scores


class ForcedBOS(BatchedProcessor):
    """``ForcedBOSTokenLogitsProcessor``: a row of one id gets only ``bos_token_id`` (0, the rest -inf)."""

    __slots__ = ("bos_token_id",)

    def __init__(self, bos_token_id: int) -> None:
        self.bos_token_id = int(bos_token_id)

    @property
    def key(self) -> tuple:
        return ("forced_bos", self.bos_token_id)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        return _force(scores, _active(rows.lengths == 1, scores.device), (self.bos_token_id,))


class ForcedEOS(BatchedProcessor):
    """``ForcedEOSTokenLogitsProcessor``: a row of ``max_length - 1`` ids gets only EOS (0, the rest -inf)."""

    __slots__ = ("max_length", "eos")

    def __init__(self, max_length: int, eos: Sequence[int]) -> None:
        self.max_length, self.eos = int(max_length), tuple(int(t) for t in eos)

    @property
    def key(self) -> tuple:
        return ("forced_eos", self.eos)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        return _force(scores, _active(rows.lengths == _per_row(peers, "max_length") - 1, scores.device), self.eos)


def _force(scores: torch.Tensor, active: torch.Tensor | None, tokens: tuple[int, ...]) -> torch.Tensor:
    if active is not None:
        scores[active] = -math.inf
        scores[active[:, None], _index(tokens, scores.device)[None, :]] = 0.0
    return scores


class SuppressTokens(BatchedProcessor):
    """``SuppressTokensLogitsProcessor``: ``tokens`` are -inf in every row."""

    __slots__ = ("tokens",)
    reads_rows = False

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tuple(int(t) for t in tokens)

    @property
    def key(self) -> tuple:
        return ("suppress_tokens", self.tokens)

    def __call__(self, rows: Rows | None, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        tokens = _in_vocab(self.tokens, scores.shape[-1])
        return scores.index_fill_(1, _index(tokens, scores.device), -math.inf) if tokens else scores


class SuppressTokensAtBegin(BatchedProcessor):
    """``SuppressTokensAtBeginLogitsProcessor``: ``tokens`` are -inf in a row of exactly ``begin_index`` ids."""

    __slots__ = ("tokens", "begin_index")

    def __init__(self, tokens: Sequence[int], begin_index: int) -> None:
        self.tokens, self.begin_index = tuple(int(t) for t in tokens), int(begin_index)

    @property
    def key(self) -> tuple:
        return ("suppress_tokens_at_begin", self.tokens)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        active = _active(rows.lengths == _per_row(peers, "begin_index"), scores.device)
        return _mask_tokens(scores, active, self.tokens)


class SequenceBias(BatchedProcessor):
    """``SequenceBiasLogitsProcessor`` (and ``NoBadWordsLogitsProcessor``, its biases -inf): a
    one-token sequence's bias always applies; a longer one's applies to its last token where the
    row ends with the rest of it. ``sequence_bias``: ``{token ids: bias}``, in transformers' order
    (the order of the additions, hence part of the key)."""

    __slots__ = ("sequence_bias", "_prepared")

    def __init__(self, sequence_bias: Mapping[tuple[int, ...], float]) -> None:
        # May be empty: NoBadWordsLogitsProcessor drops one-token bad words that are EOS
        self.sequence_bias = tuple((tuple(int(t) for t in ids), float(bias)) for ids, bias in sequence_bias.items())
        self._prepared: dict[tuple[int, torch.device], tuple] = {}

    @property
    def key(self) -> tuple:
        return ("sequence_bias", self.sequence_bias)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        length_1_bias, groups = self._prepare(scores.shape[-1], scores.device)
        bias = torch.zeros_like(scores)
        bias += length_1_bias
        for prefixes, last_tokens, biases in groups:  # prefixes [G, k]: the sequences with k tokens before the last
            k = prefixes.shape[1]
            if not (rows.lengths >= k).any():
                continue
            tail = (rows.lengths_t[:, None] - k + torch.arange(k, device=scores.device)).clamp(min=0)  # [R, k]
            matching = (rows.ids.gather(1, tail)[:, None, :] == prefixes).all(dim=-1)  # [R, G]
            matching &= (rows.lengths_t >= k)[:, None]  # a row shorter than the prefix cannot end with it
            bias.index_add_(1, last_tokens, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias

    def _prepare(self, vocab_size: int, device: torch.device) -> tuple:
        """transformers' ``_prepare_bias_variables``, once per vocabulary size and device."""
        if (vocab_size, device) not in self._prepared:
            invalid = [t for ids, _ in self.sequence_bias for t in ids if t >= vocab_size]
            if invalid:
                raise ValueError(
                    f"The model vocabulary size is {vocab_size}, but the following tokens were being biased: {invalid}"
                )
            length_1_bias = torch.zeros(vocab_size, dtype=torch.float, device=device)
            singles = [(ids[0], bias) for ids, bias in self.sequence_bias if len(ids) == 1]
            if singles:
                length_1_bias[[t for t, _ in singles]] = torch.tensor([b for _, b in singles], device=device)
            by_length: dict[int, list[tuple[tuple[int, ...], float]]] = {}
            for ids, bias in self.sequence_bias:
                if len(ids) > 1:
                    by_length.setdefault(len(ids) - 1, []).append((ids, bias))
            groups = [
                (
                    torch.tensor([ids[:-1] for ids, _ in group], device=device),
                    torch.tensor([ids[-1] for ids, _ in group], device=device),
                    torch.tensor([bias for _, bias in group], dtype=torch.float, device=device),
                )
                for group in by_length.values()
            ]
            self._prepared[(vocab_size, device)] = (length_1_bias, groups)
        return self._prepared[(vocab_size, device)]


class PresenceFrequencyPenalty(BatchedProcessor):
    """OpenAI's (and vLLM's) penalties over the row's *generated* tokens only (not the prompt):
    ``score -= frequency * count; score -= presence * (count > 0)``. Per row: not in the key."""

    __slots__ = ("presence", "frequency")

    def __init__(self, presence: float = 0.0, frequency: float = 0.0) -> None:
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        self.presence, self.frequency = float(presence), float(frequency)

    @property
    def key(self) -> tuple:
        return ("presence_frequency",)

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        vocab_size, ids = scores.shape[-1], rows.ids
        generated = (torch.arange(ids.shape[1], device=ids.device) >= rows.starts_t[:, None]) & (ids >= 0)
        columns = torch.where(generated, ids.clamp(max=vocab_size), vocab_size)  # [R, L]; the rest: a spare column
        counts = torch.zeros(scores.shape[0], vocab_size + 1, dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, columns, generated.to(scores.dtype))
        counts = counts[:, :vocab_size]
        values = [(p.frequency, p.presence) for p in peers]  # type: ignore[attr-defined]
        penalties = torch.tensor(values, dtype=scores.dtype).to(scores.device)  # [R, 2]
        scores -= penalties[:, :1] * counts
        scores -= penalties[:, 1:] * (counts > 0).to(scores.dtype)
        return scores


class LogitBias(BatchedProcessor):
    """OpenAI's ``logit_bias``: ``{token id: bias}`` added to the row's scores, each bias clamped to
    [-100, 100] as vLLM does. Per row: not in the key."""

    __slots__ = ("tokens", "biases")
    reads_rows = False

    def __init__(self, logit_bias: Mapping[int, float]) -> None:
        tokens, biases = [], []
        for token, bias in logit_bias.items():
            token = int(token) if isinstance(token, str) and token.strip().isdigit() else token  # JSON keys are strings
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise ValueError(f"logit_bias[{token}] must be a number, got {bias!r}")
            tokens.append(token)
            biases.append(min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT))
        self.tokens = np.array(tokens, dtype=np.int64)
        self.biases = np.array(biases, dtype=np.float32)

    @property
    def key(self) -> tuple:
        return ("logit_bias",)

    def __call__(self, rows: Rows | None, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        tokens = np.concatenate([p.tokens for p in peers])  # type: ignore[attr-defined]
        if not tokens.size:
            return scores
        if tokens.max() >= scores.shape[-1]:
            raise ValueError(f"logit_bias has token ids outside the vocabulary of {scores.shape[-1]}: {tokens.max()}")
        counts = [len(p.tokens) for p in peers]  # type: ignore[attr-defined]
        where = torch.from_numpy(np.stack([np.repeat(np.arange(len(peers)), counts), tokens])).to(scores.device)
        biases = torch.from_numpy(np.concatenate([p.biases for p in peers])).to(scores.device, scores.dtype)  # type: ignore[attr-defined]
        return scores.index_put_((where[0], where[1]), biases, accumulate=True)


class RowFree(BatchedProcessor):
    """One of transformers' processors that never reads the ids (temperature, top-k, top-p, ...),
    run as is on the stacked rows. Keyed by its type and settings."""

    __slots__ = ("processor",)
    reads_rows = False

    def __init__(self, processor: LogitsProcessor) -> None:
        self.processor = processor

    @property
    def key(self) -> tuple:
        return (type(self.processor).__name__, tuple(sorted(vars(self.processor).items())))

    def __call__(self, rows: Rows | None, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        no_ids = torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)  # they ignore the ids
        return self.processor(no_ids, scores)


class Opaque(BatchedProcessor):
    """A processor the plan cannot batch (a caller's own, a subclass, unusual settings): it runs
    row by row on each row's ``[1, len]`` ids, as ``generate`` with one prompt would call it (for
    transformers' batch semantics, run it on a ``GenerateBatch``). Rows stack only if they share
    the very instance (a ``generate`` call's rows do)."""

    __slots__ = ("processor",)

    def __init__(self, processor: LogitsProcessor) -> None:
        self.processor = processor

    @property
    def key(self) -> tuple:
        return ("opaque", id(self.processor))  # the plan holds the processor, so the id stays its own

    def __call__(self, rows: Rows, scores: torch.Tensor, peers: Sequence[BatchedProcessor]) -> torch.Tensor:
        return torch.cat(
            [self.processor(rows.ids[i : i + 1, : rows.lengths[i]], scores[i : i + 1]) for i in range(len(rows))]
        )


