"""Requests: one sequence's state from queueing to its final output."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .holds import GrammarMatcher, ImageInputs, Sampling, Speculation, TensorLike


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability under the processed distribution (after temperature,
    top-k/top-p and the other logits processors, as vLLM reports by default), and the ``k`` most
    likely alternatives there, best first. A prompt token's (``prompt_logprobs``) is under the
    model's raw distribution given the tokens before it, as vLLM's and lm-eval's ``hf`` model's are."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # a prompt token's: 1 + how many tokens were likelier (vLLM's prompt_logprobs rank)


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far; ``finished`` is set on its last output."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    new_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length", "eos", "stop", "abort", "error"
    error: str | None = None
    # what raised, for a caller that re-raises it (``model.generate`` raises a caller's processor's own error)
    exception: BaseException | None = None
    num_cached_tokens: int = 0
    scores: list[TensorLike] | None = None  # per new token: processed scores [vocab] (generate's `scores`)
    logits: list[TensorLike] | None = None  # per new token: raw logits [vocab] (generate's `logits`)
    logprobs: list[TokenLogprob] | None = None  # per new token, when the request asked for them
    parent_id: str | None = None  # num_return_sequences: the request this sequence was forked from
    index: int = 0  # its place among the parent's sequences (the parent is 0)
    score: float | None = None  # beam search: the hypothesis' length-penalized score (sequences_scores)
    beam_indices: list[int] | None = None  # beam search: the beam each generated token came from
    # prompt_logprobs=k: one entry per prompt token, None for the first (nothing comes before it);
    # set on every output once the whole prompt is scored
    prompt_logprobs: list[TokenLogprob | None] | None = None


class BeamGroup(Protocol):
    """The beams of a beam-search request (``runtime.generation.beam.BeamGroup``): scheduled, preempted
    and sized together."""

    num_beams: int

    @property
    def beams(self) -> Sequence[Request]: ...


@dataclass(slots=True, eq=False)
class Request:
    """Mutable state of one sequence. The scheduler owns ``block_ids`` and ``num_computed_tokens``.

    ``num_computed_tokens`` counts the tokens whose K/V sit in the cache; the tokens from there to
    ``len(all_ids)`` are what the next steps must feed the model. After preemption it drops to 0 and
    the request is recomputed from its prompt *and* the tokens it already generated.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling | None  # None only in tests of the scheduler alone
    arrival: int  # order of arrival: the scheduling policy's tie-break
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # the block table of attention group 0
    extra_block_ids: list[list[int]] = field(default_factory=list)  # those of groups 1, 2, ... (hybrid models)
    block_digests: list[bytes] = field(default_factory=list)  # prefix-cache chain digests (kv_manager)
    cache_epoch: int = 0  # the allocator's epoch when its K/V began: only then do its blocks join the cache
    finish_reason: str | None = None
    error: str | None = None
    exception: BaseException | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    priority: int = 0  # the "priority" policy runs lower values first
    parent_id: str | None = None  # set on a forked sequence (num_return_sequences)
    index: int = 0  # 0 for the parent, k for its k-th forked sibling
    children: list[Request] = field(default_factory=list)  # forked after the prompt's first sample
    new_ids: list[int] = field(default_factory=list)
    scores: list[TensorLike] | None = None
    logits: list[TensorLike] | None = None
    logprobs: list[TokenLogprob] | None = None
    group: BeamGroup | None = None  # of a beam-search request and of its beams (preempted together)
    matcher: GrammarMatcher | None = None  # a constrained request's grammar state
    score: float | None = None
    beam_indices: list[int] | None = None
    # Speculative decoding (runtime/speculative): tokens proposed after the last known one, fed with
    # it for verification and kept out of ``output_ids`` (and so out of every prefix-cache key)
    # until accepted; ``lookahead``: how many the scheduler reserves room for at the next decode step
    draft_ids: list[int] = field(default_factory=list)
    lookahead: int = 0
    # its speculative state (acceptance, proposer's); False once the speculator found it does not speculate
    speculation: Speculation | bool | None = None
    # prompt_logprobs=k: the scores of the prompt's tokens so far, in order (entry 0 is None). The
    # positions still to score get logits rows of their own (``prompt_positions``); while any is
    # missing the prefix cache serves the request nothing (a hit would skip its positions).
    num_prompt_logprobs: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The LoRA adapter every token of the request runs under (None: the base model); its name roots
    # the request's prefix-cache digests, so K/V computed under one adapter never serves another.
    adapter: str | None = None
    # Images (runtime/multimodal.py): ``multimodal`` holds their tensors and encoder output;
    # ``mm_spans`` each image's (first prompt position, number of tokens, content digest): the tokens of an
    # image are placeholders, so the prefix-cache key of every block an image touches carries its digest
    multimodal: ImageInputs | None = None
    mm_spans: tuple[tuple[int, int, bytes], ...] = ()
    # Only the final output is wanted (a batch call collecting finished requests, as vLLM's ``FINAL_ONLY``):
    # a step that records tokens without finishing the request emits nothing for it; ``new_ids`` then hold
    # every token at its finish
    final_only: bool = False

    def block_extra(self, start: int, stop: int) -> bytes:
        """What the prefix-cache key of the block of positions ``start .. stop - 1`` holds besides its token
        ids: the position and digest of every image with tokens there (b"" for a block of text alone)."""
        parts = [
            first.to_bytes(8, "little") + digest
            for first, length, digest in self.mm_spans
            if first < stop and first + length > start
        ]
        return b"".join(parts)

    @property
    def block_tables(self) -> list[list[int]]:
        """One block table per attention group (the lists themselves, for the KV manager to edit)."""
        return [self.block_ids, *self.extra_block_ids]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """``all_ids[start : start + n]`` without building ``all_ids`` (a decode step's one token)."""
        cut = len(self.prompt_ids)
        if start >= cut:
            return self.output_ids[start - cut : start - cut + n]
        return (self.prompt_ids[start : start + n] + self.output_ids[: max(start + n - cut, 0)])[:n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to be fed to the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """True while prompt log-probabilities are asked for and some prompt token is not scored."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def prompt_positions(self, start: int, n: int) -> range:
        """The positions among ``start .. start + n - 1`` (a chunk fed to the model) whose logits
        score a prompt token not scored yet: position ``p`` scores token ``p + 1``. The last prompt
        position is not among them: its logits are the first sample's."""
        if not self.scores_prompt:
            return range(0)
        assert self.prompt_logprobs is not None
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + n, len(self.prompt_ids) - 1))

    def append(
        self, token: int, scores: TensorLike | None = None, logits: TensorLike | None = None,
        logprob: TokenLogprob | None = None,
    ) -> None:
        """A new token, with what the request records along with it (None: nothing to record)."""
        self.output_ids.append(token)
        self.new_ids.append(token)
        if scores is None and logits is None and logprob is None:  # most tokens: nothing else to record
            return
        for name, value in (("scores", scores), ("logits", logits), ("logprobs", logprob)):
            if value is not None:
                if getattr(self, name) is None:
                    setattr(self, name, [])
                getattr(self, name).append(value)

    def finish(self, reason: str, exception: BaseException | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = f"{type(exception).__name__}: {exception}" if exception is not None else None
        self.exception = exception

    def take_output(self) -> RequestOutput:
        """The output for this step; clears the step's new ids."""
        out = RequestOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            output_ids=list(self.output_ids),
            new_ids=self.new_ids,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            exception=self.exception,
            num_cached_tokens=self.num_cached_tokens,
            scores=self.scores,
            logits=self.logits,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            parent_id=self.parent_id,
            index=self.index,
            score=self.score,
            beam_indices=self.beam_indices,
            prompt_logprobs=None if self.scores_prompt else self.prompt_logprobs,  # once the prompt is scored
        )
        self.new_ids = []
        return out

    def fork(self, index: int) -> Request:
        """A sibling sequence that will share this request's blocks once its prompt is computed."""
        return Request(
            request_id=f"{self.request_id}#{index}",
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            # sampling.RequestSampling.for_sequence: a seeded sequence gets its own generator
            sampling=self.sampling.for_sequence(index) if self.sampling is not None else None,
            arrival=self.arrival,
            priority=self.priority,
            parent_id=self.request_id,
            index=index,
            matcher=self.matcher.clone() if self.matcher is not None else None,  # its own grammar state
            # the parent scores the prompt they share; the list it fills is theirs too
            num_prompt_logprobs=self.num_prompt_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            adapter=self.adapter,
            multimodal=self.multimodal,  # a sibling recomputing its prompt after a preemption needs its images
            mm_spans=self.mm_spans,
        )


def validate_prompt(
    input_ids: Sequence[int] | TensorLike, vocab_size: int, max_positions: int | None
) -> list[int]:
    """One prompt as a list of token ids, or ValueError naming what is wrong with it.

    ``input_ids`` may be a 1-D (or [1, n]) torch tensor; it is duck-typed so that this module and
    the scheduler above it stay free of torch.
    """
    if hasattr(input_ids, "dim") and hasattr(input_ids, "tolist"):  # a torch tensor
        if input_ids.is_floating_point() or input_ids.is_complex() or str(input_ids.dtype) == "torch.bool":
            raise ValueError(f"input_ids must hold integers, got dtype {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be one prompt (1-D), got shape {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    prompt = list(input_ids)
    if not prompt:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise ValueError(f"input_ids must be ints, got {bad[0]!r}")
    out_of_range = [t for t in prompt if not 0 <= t < vocab_size]
    if out_of_range:
        raise ValueError(f"token id {out_of_range[0]} is outside the vocabulary [0, {vocab_size})")
    if max_positions and len(prompt) > max_positions:
        raise ValueError(
            f"prompt of {len(prompt)} tokens is longer than max_position_embeddings={max_positions}"
        )
    return prompt
