"""The engine's ``RequestOutput`` as transformers' ``GenerationOutput``.

Request ids follow transformers' continuous batching: the caller's, else ``req_<n>``; the
``num_return_sequences - 1`` siblings of ``req_0`` are ``req_0__child#0``, ``req_0__child#1``, ...
(the engine's ``req_0#1``, ``req_0#2``, ...). A ``Ledger`` keeps what a ``GenerationOutput`` says
beyond the tokens: when the request was created, when it produced its first token and finished,
each token's time when ``record_timestamps``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from ..core.request import RequestOutput

FINISHED_REASONS = ("length", "eos", "stop")


def hf_request_id(out: RequestOutput) -> str:
    """transformers' id of an engine output: a forked sibling ``k`` of ``p`` is ``p__child#{k-1}``."""
    return out.request_id if out.parent_id is None else f"{out.parent_id}__child#{out.index - 1}"


@dataclass(slots=True)
class Entry:
    """One prompt's request and its forked siblings (``num_sequences`` in all)."""

    num_sequences: int = 1
    streaming: bool = False
    record_timestamps: bool = False
    created: float = field(default_factory=time.perf_counter)
    started: float = -1.0
    timestamps: dict[str, list[float]] = field(default_factory=dict)  # by engine request id


class Ledger:
    """Per-request bookkeeping (thread-safe: the caller adds, the loop's thread converts)."""

    def __init__(self, return_logprobs: bool) -> None:
        self.return_logprobs = return_logprobs
        self._entries: dict[str, Entry] = {}  # by the engine's id of the prompt's request
        self._lock = threading.Lock()

    def add(
        self, request_id: str, num_sequences: int = 1, streaming: bool = False, record_timestamps: bool = False
    ) -> None:
        with self._lock:
            self._entries[request_id] = Entry(num_sequences, streaming, record_timestamps)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def convert(self, out: RequestOutput) -> GenerationOutput | None:
        """The output to deliver for ``out``: every output of a streaming request, the final one of
        the others; None when there is nothing to deliver (an aborted request, as transformers)."""
        now = time.perf_counter()
        with self._lock:
            key = out.parent_id or out.request_id
            entry = self._entries.get(key)
            if entry is not None and out.finished:
                entry.num_sequences -= 1
                if not entry.num_sequences:  # the family is done: forget it
                    del self._entries[key]
        if entry is None or out.finish_reason == "abort":
            return None
        if entry.started < 0 and (out.new_ids or out.finished):
            entry.started = now
        stamps = entry.timestamps.setdefault(out.request_id, [])
        if entry.record_timestamps:
            stamps.extend([now] * len(out.new_ids))
        if not (out.finished or entry.streaming):
            return None
        failed = out.finish_reason == "error"
        if out.finished:
            status = RequestStatus.FAILED if failed else RequestStatus.FINISHED
        else:
            status = RequestStatus.DECODING
        logprobs = [lp.logprob for lp in out.logprobs or []] if self.return_logprobs else []
        return GenerationOutput(
            request_id=hf_request_id(out),
            prompt_ids=list(out.prompt_ids),
            generated_tokens=list(out.output_ids),
            logprobs=logprobs,
            error=out.error,
            status=status,
            created_time=entry.created,
            lifespan=(entry.started, now if out.finished else -1),
            timestamps=list(stamps) if entry.record_timestamps else None,
        )
