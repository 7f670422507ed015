"""Lockstep: the rows of one ``model.generate`` call sampled in the same step, so that the caller's
logits processors and stopping criteria run once per step on the whole ``[batch, len]`` batch, as
in transformers' ``_sample``.

A caller's processor or criterion may read every row at once and keep state across steps (lm-eval's
``MultiTokenEOSCriteria`` keeps a ``done_tracker`` per row and returns one bool for the batch), so it
must see exactly what ``generate`` shows it: every row of the batch, its padding, the rows that
already finished padded with ``pad_token_id``, once per step. ``GenerateBatch`` (``processors/``)
builds those ids; ``Lockstep`` collects the rows' logits as a beam group does (a row whose logits
are in waits, with nothing to compute, until every live row's are), then runs the batch's
processors, draws, runs the criteria and says which rows finish.

A criterion's answer applies as in ``generate``: one bool stops every row; a row it stops is
padded from then on when EOS is set. Without EOS, ``generate`` keeps sampling a stopped row until
every row has stopped (or the length limit): so does the batch. A row aborted through the engine is
padded like a finished one when EOS is set; without EOS its batch fails (``generate`` would go on
sampling it: there is nothing to show in its place). Beam search keeps its own
processors (``beam.py``). Only calls that carry a caller's processor or criterion run in lockstep;
the others sample each row as it comes (``sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ...core.request import Request
from .processors import GenerateBatch
from .sampling import Sample, draw


@dataclass(slots=True)
class LockstepStep:
    """What one step decided: siblings to fork (``num_return_sequences``, at the first step) and,
    per live row in batch order, its sample and its finish reason (None: it goes on)."""

    forks: list[tuple[Request, Request]] = field(default_factory=list)
    rows: list[tuple[Request, Sample, str | None]] = field(default_factory=list)


class Lockstep:
    """The rows of one ``generate`` call that carries a caller's processors or criteria.

    ``input_ids`` [batch, width]: ``generate``'s batch after ``num_return_sequences``' expansion
    (prompt ``i``'s sequences are rows ``i * n`` to ``i * n + n - 1``), padding included.
    ``processors``: the whole list ``generate`` builds for that batch (the caller's merged in);
    ``criteria``: the criteria beyond EOS and length (``sampling.make_stopping_criteria``), or None.
    ``pad_token_id``: the prepared config's pad id when it has EOS, else None (as ``GenerateBatch``).
    ``bind`` gives each row its request before the first step.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        processors: LogitsProcessorList,
        criteria: StoppingCriteriaList | None,
        pad_token_id: int | None,
        eos_token_ids: frozenset[int],
        do_sample: bool,
        output_scores: bool = False,
        output_logits: bool = False,
    ) -> None:
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.processors = processors
        self.criteria = criteria
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.do_sample = do_sample
        self.output_scores = output_scores
        self.output_logits = output_logits
        self.requests: list[Request] = []
        self.source: dict[int, int] = {}  # a sibling's row -> its parent's row, whose first logits it shares
        self.row_of: dict[int, int] = {}  # id(request) -> its row
        self.pending: dict[int, torch.Tensor] = {}  # row -> its logits [vocab] for this step
        self.stopped: set[int] = set()  # rows a criterion stopped (without EOS they go on being sampled)
        self.recorded: tuple[torch.Tensor, ...] = ()  # per step [batch, vocab] scores, for the criteria
        self.batch: GenerateBatch | None = None  # on the logits' device, at the first step
        self.num_steps = 0

    def bind(self, families: list[list[Request]]) -> None:
        """Row order: each prompt's request, then its ``num_return_sequences - 1`` siblings."""
        for family in families:
            parent = len(self.requests)
            for k, request in enumerate(family):
                if k:
                    self.source[len(self.requests)] = parent
                self.row_of[id(request)] = len(self.requests)
                self.requests.append(request)
        if len(self.requests) != self.input_ids.shape[0]:
            raise ValueError(f"{len(self.requests)} requests for a batch of {self.input_ids.shape[0]} rows")

    # ------------------------------------------------------------------ collecting the step
    def receive(self, request: Request, logits: torch.Tensor) -> bool:
        """Record a row's logits [vocab] for this step; True once every live row's are in."""
        self.pending[self.row_of[id(request)]] = logits
        return self.ready()

    def ready(self) -> bool:
        live = self._live()
        return bool(live) and all(self._logits_row(b) in self.pending for b in live)

    def live_requests(self) -> list[Request]:
        """The rows still generating that the engine runs (siblings only once forked)."""
        return [self.requests[b] for b in self._live() if self.num_steps or b not in self.source]

    def _live(self) -> list[int]:
        return [b for b, r in enumerate(self.requests) if not r.finished]

    def _logits_row(self, row: int) -> int:
        """Where a row's logits come from: itself, or at the first step a sibling's parent."""
        return self.source[row] if not self.num_steps and row in self.source else row

    # ------------------------------------------------------------------ the step
    def advance(self, generator: torch.Generator | None) -> LockstepStep:
        """One step of ``generate``'s loop on the pending logits: processors on the batch, draw,
        append, criteria on the batch. Changes no request: the engine records what it returns."""
        live = self._live()
        logits = torch.stack([self.pending[self._logits_row(b)] for b in live])  # [R, vocab]
        self.pending = {}
        if self.batch is None:
            self.batch = GenerateBatch(self.input_ids.to(logits.device), self.max_new_tokens, self.pad_token_id)
        for b, request in enumerate(self.requests):  # finished since the last step (abort): padded now
            if request.finished and bool(self.batch.unfinished[b]):
                self.batch.finish(b)
        scores = self.batch.process(self.processors, live, logits.clone())  # [R, vocab]
        tokens = (draw(torch.softmax(scores, dim=-1), generator) if self.do_sample else scores.argmax(dim=-1)).tolist()
        self.batch.append(live, tokens)
        if self.output_scores:
            self.recorded += (self.batch.batch_scores(live, scores),)
        stop = self.batch.should_stop(self.criteria, self.recorded or None) if self.criteria else None
        step = LockstepStep()
        if not self.num_steps:
            step.forks = [(self.requests[self.source[b]], self.requests[b]) for b in live if b in self.source]
        for i, b in enumerate(live):
            sample = Sample(
                tokens[i],
                scores=scores[i].cpu() if self.output_scores else None,
                logits=logits[i].cpu() if self.output_logits else None,
            )
            step.rows.append((self.requests[b], sample, self._reason(b, tokens[i], stop)))
        if self.pad_token_id is None and len(self.stopped) == len(self.requests):  # generate's loop ends
            step.rows = [(r, s, reason or "stop") for r, s, reason in step.rows]
        for request, _, reason in step.rows:
            if reason is not None:
                self.batch.finish(self.row_of[id(request)])
        self.num_steps += 1
        return step

    def _reason(self, row: int, token: int, stop: torch.Tensor | None) -> str | None:
        """Why ``row`` finishes after ``token``, in the engine's order (EOS, criteria, length), or None."""
        if token in self.eos_token_ids:
            return "eos"
        if stop is not None and bool(stop[row]):
            self.stopped.add(row)
            if self.pad_token_id is not None:  # with EOS, generate pads the row from now on
                return "stop"
        if len(self.requests[row].output_ids) + 1 >= self.requests[row].max_new_tokens:
            return "length"
        return None
