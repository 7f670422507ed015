"""Logits processors on stacked rows, with transformers' semantics.

transformers runs each processor once per step on the whole ``[batch, len]`` ids of a ``generate``
call. The engine's rows are ragged (each request has its own length, its own left padding) and come
and go every step, so running transformers' processors means one call per row on a ``[1, len]``
tensor built from Python lists. Here instead:

* ``TokenHistory`` keeps every tracked request's ids on the device, one row each, and appends a
  step's tokens to all rows with one ``index_put_``. A step reads its rows as ``Rows``: ``[R, L]``
  ids, ``-1`` past each row's end, and the lengths on the host and the device.
* ``plan_processors`` turns a request's processor list (what ``model._get_logits_processor`` built)
  into a ``ProcessorPlan`` of batched processors, each equal to transformers' own on the row that
  ``generate`` would see (its left padding, prompt and generated tokens). Requests whose plans have
  equal ``key`` run them once on their stacked rows (``run_plans``): a handful of torch ops per
  processor, whatever the number of rows. Settings that may differ per row (lengths, thresholds,
  OpenAI penalties and biases) are not in the key; those the arithmetic depends on are.
* ``GenerateBatch`` rebuilds the exact ``input_ids`` transformers' ``generate`` passes to processors
  and stopping criteria at each step, for a caller's processor that must see the whole batch.

A processor the plan does not know (a caller's own, a subclass) is ``Opaque``: it runs per row on its
``[1, len]`` ids as before, or on a ``GenerateBatch``.

The engine's side, per request whose plan ``needs_rows`` (keys: the ``Request`` objects): ``add``
on the engine thread before its first sample (padding + prompt), ``fork`` a sibling before the
parent's first token is appended, one ``append`` per step for every row sampled (before any of
them is finished and released), ``release`` on finish, abort or error; nothing on preemption.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

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


# ------------------------------------------------------------------------------------------ plans
@dataclass(frozen=True, slots=True)
class ProcessorPlan:
    """A request's processors, batched. Requests with equal ``key`` run their plans together
    (``run_plans``) on stacked rows. ``tail_start``: where the trailing row-free processors begin
    (temperature, top-k, ...): ``row_free_tail`` is them as transformers' list, for a sampler
    that runs them its own way (``sampling.stacked_scores``)."""

    steps: tuple[BatchedProcessor, ...]
    key: tuple
    tail_start: int

    @classmethod
    def of(cls, steps: Sequence[BatchedProcessor]) -> ProcessorPlan:
        tail_start = len(steps)
        while tail_start and isinstance(steps[tail_start - 1], RowFree):
            tail_start -= 1
        return cls(tuple(steps), tuple(step.key for step in steps), tail_start)

    @property
    def needs_rows(self) -> bool:
        """Whether running the plan reads the rows' ids or lengths (a ``TokenHistory`` must track them)."""
        return any(step.reads_rows for step in self.steps)

    @property
    def row_free_tail(self) -> LogitsProcessorList:
        return LogitsProcessorList(step.processor for step in self.steps[self.tail_start :])  # type: ignore[attr-defined]


def run_plans(
    plans: Sequence[ProcessorPlan], rows: Rows | None, scores: torch.Tensor, *, tail: bool = True
) -> torch.Tensor:
    """Run ``plans`` (one per row, all with one key) once on the stacked ``scores`` [R, vocab]
    float; ``rows``: the same rows' ids (None if no plan ``needs_rows``). ``tail=False`` stops
    before the row-free tail. ``scores`` may be changed in place; returns the processed scores."""
    first = plans[0]
    assert len(plans) == scores.shape[0] and (rows is None or len(rows) == len(plans))
    for j, step in enumerate(first.steps[: None if tail else first.tail_start]):
        scores = step(rows, scores, [plan.steps[j] for plan in plans])
    return scores


def stacks(plans: Sequence[ProcessorPlan]) -> list[list[int]]:
    """The indices of ``plans`` grouped by key, in first-seen order: each group runs as one stack."""
    groups: dict[tuple, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan.key, []).append(i)
    return list(groups.values())


def plan_processors(
    processors: Sequence[LogitsProcessor],
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
) -> ProcessorPlan:
    """The batched plan of ``processors`` (the list ``model._get_logits_processor`` built for one
    request, in its order), with OpenAI's extras: ``logit_bias`` first and the presence/frequency
    penalties right after the repetition penalty, else before the row-free tail (vLLM's order:
    logit bias, then repetition, frequency and presence penalties, then temperature and the rest).
    A processor of a type we batch is matched by exact type (a subclass may change ``__call__``)."""
    steps: list[BatchedProcessor] = [_batched(p) for p in processors]
    if presence_penalty or frequency_penalty:
        penalties = PresenceFrequencyPenalty(presence_penalty, frequency_penalty)
        after = [i for i, s in enumerate(steps) if isinstance(s, RepetitionPenalty)]
        steps.insert(after[0] + 1 if after else ProcessorPlan.of(steps).tail_start, penalties)
    if logit_bias:
        steps.insert(0, LogitBias(logit_bias))
    return ProcessorPlan.of(steps)


def openai_options(config: GenerationConfig) -> dict[str, object]:
    """``plan_processors``' OpenAI keywords from a GenerationConfig: ``GenerationConfig(presence_penalty=0.5,
    frequency_penalty=0.2, logit_bias={50256: -100})`` keeps them as plain attributes (transformers
    ignores them), so they travel with the request's config like its other options."""
    return {
        "presence_penalty": getattr(config, "presence_penalty", None) or 0.0,
        "frequency_penalty": getattr(config, "frequency_penalty", None) or 0.0,
        "logit_bias": getattr(config, "logit_bias", None) or None,
    }


def _batched(p: LogitsProcessor) -> BatchedProcessor:
    kind = type(p)
    if kind in ROW_FREE_PROCESSORS:
        plain = all(isinstance(v, (bool, int, float, str, type(None))) for v in vars(p).values())
        return RowFree(p) if plain else Opaque(p)
    if kind is RepetitionPenaltyLogitsProcessor:
        ignore = _ignore_length(p)
        return RepetitionPenalty(p.penalty, ignore) if ignore is not None else Opaque(p)
    if kind is NoRepeatNGramLogitsProcessor:
        return NoRepeatNGram(p.ngram_size)
    if kind is MinLengthLogitsProcessor:
        return MinLength(p.min_length, _ids(p.eos_token_id))
    if kind is MinNewTokensLengthLogitsProcessor:
        return MinNewTokens(p.prompt_length_to_skip, p.min_new_tokens, _ids(p.eos_token_id))
    if kind in (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor) and isinstance(p.sequence_bias, dict):
        return SequenceBias(p.sequence_bias)
    if kind is ForcedBOSTokenLogitsProcessor:
        return ForcedBOS(p.bos_token_id)
    if kind is ForcedEOSTokenLogitsProcessor:
        return ForcedEOS(p.max_length, _ids(p.eos_token_id))
    if kind is SuppressTokensLogitsProcessor:
        return SuppressTokens(_ids(p.suppress_tokens))
    if kind is SuppressTokensAtBeginLogitsProcessor:
        return SuppressTokensAtBegin(_ids(p.begin_suppress_tokens), p.begin_index)
    return Opaque(p)


def _ids(value: int | Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        return tuple(value.flatten().tolist())
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _ignore_length(p: RepetitionPenaltyLogitsProcessor) -> int | None:
    """The row's ``prompt_ignore_length`` as one int (None: it cannot be one row's, e.g. a tensor
    over a caller's whole batch, or continuous-batching's 3-D mode is set up)."""
    if getattr(p, "logits_indices", None) is not None or getattr(p, "cu_seq_lens_q", None) is not None:
        return None
    value = p.prompt_ignore_length
    if value is None or isinstance(value, int):
        return value or 0
    values = value.flatten().tolist()  # one row, or a beam group's rows, all with the same padding
    return int(values[0]) if values and len(set(values)) == 1 else None


# ------------------------------------------------------------------------------------------ generate's batch
class GenerateBatch:
    """The ``input_ids`` transformers' ``generate`` hands its processors and stopping criteria at
    each step, for the rows of one call, so a caller's processor or criterion runs once per step
    on the whole batch, as there.

    Row ``b`` is row ``b`` of ``generate``'s batch (after ``num_return_sequences``' expansion:
    prompt ``i``'s sequences are rows ``i * n`` to ``i * n + n - 1``): its left padding and prompt,
    then one token per step. In transformers' ``_sample`` a finished row goes on receiving
    ``pad_token_id`` (``next_tokens * unfinished + pad * (1 - unfinished)``) when the stopping
    criteria include EOS, i.e. when an ``eos_token_id`` is set; it keeps its EOS. Without EOS a row
    stopped early (by a caller's criterion) keeps being *sampled* there, which the engine cannot
    reproduce: ``append`` then raises. (transformers defers the stop check by one step only on
    MPS; the extra step is undone and not reproduced here.)

    ``pad_token_id``: the prepared config's ``_pad_token_tensor`` when its ``_eos_token_tensor`` is
    set, else None. The caller keeps the batch in step: ``append`` takes a token for every
    unfinished row at once.
    """

    def __init__(self, input_ids: torch.Tensor, max_new_tokens: int, pad_token_id: int | None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, len], got shape {tuple(input_ids.shape)}")
        batch, width = input_ids.shape
        self.buffer = torch.empty(batch, width + max_new_tokens, dtype=torch.long, device=input_ids.device)
        self.buffer[:, :width] = input_ids
        self.length = width
        self.pad_token_id = pad_token_id
        self.unfinished = torch.ones(batch, dtype=torch.bool)  # host

    @property
    def batch_size(self) -> int:
        return self.buffer.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """[batch, padded prompt + steps so far] int64: what ``generate`` passes at this step (a view)."""
        return self.buffer[:, : self.length]

    def finish(self, row: int) -> None:
        """Row ``row`` finished (its last token is in): from the next step on it is padded."""
        self.unfinished[row] = False

    def append(self, rows: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> None:
        """This step's tokens: ``tokens[i]`` is row ``rows[i]``'s; ``rows`` must be exactly the unfinished rows."""
        unfinished = torch.nonzero(self.unfinished).flatten().tolist()
        if sorted(rows) != unfinished:
            raise ValueError(f"a step needs a token from every unfinished row {unfinished}, got rows {sorted(rows)}")
        if self.length == self.buffer.shape[1]:
            raise ValueError(f"the batch already holds its {self.buffer.shape[1]} columns")
        if len(rows) < self.batch_size and self.pad_token_id is None:
            raise ValueError(
                "a row finished before the others without EOS in the stopping criteria: transformers' generate "
                "would keep sampling it, the engine does not"
            )
        column = self.buffer[:, self.length]
        column.fill_(self.pad_token_id if self.pad_token_id is not None else 0)
        index = torch.tensor(list(rows), dtype=torch.long, device=column.device)
        column[index] = torch.as_tensor(tokens, dtype=torch.long).to(column.device).view(-1)
        self.length += 1

    def batch_scores(self, rows: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        """[batch, vocab]: ``scores[i]`` in row ``rows[i]``, zeros in the others (transformers would
        pass a finished row's logits there: the engine no longer computes them)."""
        full = scores.new_zeros(self.batch_size, scores.shape[-1])
        full[torch.tensor(list(rows), dtype=torch.long, device=scores.device)] = scores
        return full

    def process(self, processors: LogitsProcessorList, rows: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        """``processors`` once on the whole batch, as ``generate`` calls them; ``scores`` [len(rows),
        vocab] are rows ``rows``'s, and so is what comes back."""
        index = torch.tensor(list(rows), dtype=torch.long, device=scores.device)
        return processors(self.input_ids, self.batch_scores(rows, scores))[index]

    def should_stop(self, criteria: StoppingCriteriaList, scores: object = None) -> torch.Tensor:
        """``criteria`` on the batch after this step's ``append``, as ``generate`` calls them
        (``scores``: generate passes its tuple of recorded scores, None unless ``output_scores``).
        Returns [batch] bool on the host."""
        return criteria(self.input_ids, scores).cpu()
