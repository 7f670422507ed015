"""One HTTP request's engine requests (``n`` choices per prompt) and the events they produce.

A job submits every choice to the engine loop, then turns the engine's outputs into
``ChoiceEvent``s: the text delta that is safe to send, the log-probabilities of the new tokens,
and an OpenAI ``finish_reason`` on the last one. Whatever way the consumer stops listening
(finished, client gone, server stopping), the choices still running are aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .engine_loop import EngineLoop
from .openai.protocol import APIError
from .openai.text import IncrementalText, make_decoder

# The engine's finish reasons in OpenAI's words: "stop" for EOS, stop strings and a complete structured
# output, "length" for max_tokens.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# How the engine's ValueError for a structured spec it cannot compile begins (runtime/generation/structured.py:
# the spec's field, e.g. 'json: Unimplemented keys: ["uniqueItems"]').
STRUCTURED_ERRORS = ("json", "regex", "choice", "grammar", "StructuredSpec", "structured")
# What a log-probability of -inf (a token the sampling settings exclude, e.g. outside top_p) is shown
# as: JSON has no infinity, and vLLM answers the same finite stand-in.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """``value``, or MIN_LOGPROB for -inf (and nan, which no sampler should produce)."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


@dataclass
class Choice:
    index: int
    prompt_index: int
    text: IncrementalText
    request_id: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    offset: int = 0  # characters of the tokens seen so far, for logprobs' text_offset and trimming
    prompt_scored: bool = False  # its prompt's log-probabilities (echo with logprobs) have been sent
    prompt_chars: int | None = None  # then: its prompt tokens' texts, where its own text_offsets start


@dataclass(slots=True)
class TokenInfo:
    """One token's log-probability, as OpenAI's logprobs show it (a prompt's first token has none:
    ``logprob`` and ``top`` are None, sent as ``null``)."""

    text: str  # the token decoded on its own
    logprob: float | None
    offset: int  # where it starts in the choice's text (a prompt token: in the echoed prompt)
    top: list[tuple[str, float]] | None  # the k best alternatives, best first
    token_id: int = -1
    top_ids: list[int] | None = None  # the alternatives' ids, in ``top``'s order
    rank: int | None = None  # a prompt token's rank under its distribution (1: the likeliest)

    @property
    def end(self) -> int:
        """Where the text after this token starts (its offset plus its own text's characters)."""
        return self.offset + len(self.text)


@dataclass
class ChoiceEvent:
    choice: Choice
    text: str
    logprobs: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenInfo] | None = None  # on a choice's first event, with echo and logprobs


@dataclass
class Job:
    """``prompts`` x ``n`` engine requests with the same sampling settings.

    ``engine_kwargs`` go to ``engine.add_request`` (generation_config, logprobs, seed, tokenizer,
    structured); a ``seed`` is offset by the choice's index so that ``n`` seeded choices differ.
    ``structured_param``: the request field a structured spec comes from (named in its errors).
    """

    prompts: list[list[int]]
    n: int
    max_tokens: list[int]
    stop: list[str]
    engine_kwargs: dict[str, Any]
    want_logprobs: bool = False
    structured_param: str | None = None
    min_tokens: int = 0  # no stop sequence ends in the text of the first min_tokens tokens (vLLM's)
    # echo with max_tokens=0: the engine generates one token (it always samples after the prompt),
    # which is dropped: the answer is the prompt and its log-probabilities only
    echo_only: bool = False
    choices: list[Choice] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)


class JobRun:
    """``job`` on the engine: ``submit`` (raises APIError, queues nothing on failure; may run in
    another thread than the event loop's), then iterate ``events`` until every choice has finished.
    Choices left unfinished when ``events`` stops (client gone, task cancelled) or on ``abort`` are
    aborted in the engine."""

    def __init__(self, job: Job, loop: EngineLoop, tokenizer: Any) -> None:
        self.job = job
        self.loop = loop
        self.decode = make_decoder(tokenizer)
        self.queue: asyncio.Queue = asyncio.Queue()

    def submit(self) -> None:
        job = self.job
        try:
            for p, prompt in enumerate(job.prompts):
                for j in range(job.n):
                    choice = Choice(len(job.choices), p, IncrementalText(self.decode, job.stop, job.min_tokens))
                    kwargs = dict(job.engine_kwargs)
                    if kwargs.get("seed") is not None:
                        kwargs["seed"] += j
                    choice.request_id = self.loop.submit(
                        prompt, self.queue, choice, max_new_tokens=job.max_tokens[p], **kwargs
                    )
                    job.choices.append(choice)
        except (ValueError, NotImplementedError) as exc:  # the engine refused it: the whole request fails
            self.abort()
            param = job.structured_param if job.structured_param and str(exc).startswith(STRUCTURED_ERRORS) else None
            if param is not None:
                raise APIError(400, f"{param}: the output cannot be constrained to this: {exc}", param,
                               "invalid_structured_output") from None
            raise APIError(400, str(exc), None, "invalid_request") from None
        except RuntimeError as exc:  # shutting down
            self.abort()
            raise APIError(503, str(exc), None, "shutting_down") from None

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        try:
            num_open = len(self.job.choices)
            while num_open:
                choice, out = await self.queue.get()
                if choice.finish_reason is not None:
                    continue  # stopped by a stop sequence; the engine had a step more in flight
                event = _event(choice, out, self.decode, self.job.echo_only)
                if event.finish_reason is not None:
                    num_open -= 1
                    if not out.finished:  # our stop sequence ended it: the engine never sees stop sequences
                        self.loop.abort(choice.request_id, reason="stop")
                yield event
        finally:
            self.abort()

    def abort(self) -> None:
        for choice in self.job.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self.loop.abort(choice.request_id)


def _event(choice: Choice, out: Any, decode: Callable[[list[int]], str], echo_only: bool = False) -> ChoiceEvent:
    if out.finish_reason == "error":
        raise APIError(500, f"generation failed: {out.error}", code="generation_error")
    if out.finish_reason == "abort":
        raise APIError(503, "the request was aborted (the server is shutting down, or was paused with mode=abort)",
                       code="aborted")
    scored = None
    if getattr(out, "prompt_logprobs", None) is not None and not choice.prompt_scored:
        choice.prompt_scored = True
        scored = _prompt_infos(out.prompt_ids, out.prompt_logprobs, decode)
        choice.prompt_chars = scored[-1].end
    if echo_only:  # max_tokens=0: the one token the engine generated is not part of the answer
        choice.finish_reason = "length"
        return ChoiceEvent(choice, "", finish_reason="length", prompt_logprobs=scored)
    choice.num_tokens = len(out.output_ids)
    delta = choice.text.add(out.new_ids, final=out.finished)
    event = ChoiceEvent(choice, delta, prompt_logprobs=scored)
    if choice.text.stopped:
        choice.finish_reason = "stop"
    elif out.finished:
        choice.finish_reason = FINISH_REASONS.get(out.finish_reason, "stop")
    event.finish_reason = choice.finish_reason
    if getattr(out, "logprobs", None) and out.new_ids:
        for entry in out.logprobs[-len(out.new_ids) :]:
            token = decode([entry.token_id])
            if choice.offset < len(choice.text.text) or not choice.text.stopped:  # drop what the stop cut off
                top = [(decode([t]), finite_logprob(lp)) for t, lp in entry.top]
                event.logprobs.append(TokenInfo(token, finite_logprob(entry.logprob), choice.offset, top,
                                                entry.token_id, [t for t, _ in entry.top]))
            choice.offset += len(token)
    return event


def _prompt_infos(prompt_ids: list[int], scored: list[Any], decode: Callable[[list[int]], str]) -> list[TokenInfo]:
    """The prompt's tokens with the engine's ``prompt_logprobs`` (entry 0 None), offsets in the prompt's text."""
    infos, offset = [], 0
    for token_id, entry in zip(prompt_ids, scored):
        text = decode([token_id])
        if entry is None:
            infos.append(TokenInfo(text, None, offset, None, token_id))
        else:
            top = [(decode([t]), finite_logprob(lp)) for t, lp in entry.top]
            infos.append(TokenInfo(text, finite_logprob(entry.logprob), offset, top, token_id,
                                   [t for t, _ in entry.top], getattr(entry, "rank", None)))
        offset += len(text)
    return infos
