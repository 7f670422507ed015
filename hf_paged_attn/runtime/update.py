"""What a step's logits do to its requests: the third call of the engine's step (schedule, execute,
update), as vLLM's ``update_from_output``.

In order: the computed tokens are committed to the KV-block manager (full blocks enter the prefix
cache, blocks that left a window are freed); each request whose chunk reached its end samples its
next token (stacked where requests share their sampling, ``sampling.py``); the token is recorded
with its scores and log-probs; ``num_return_sequences`` siblings are forked after the prompt's
first sample; EOS, the stopping criteria and the length limit finish requests; beam groups advance
once all their beams' logits are in. A finished request's blocks go back at once, and the engine
forgets it. One request's failure (a caller's processor or criterion that raises) finishes that
request alone with ``finish_reason="error"``.
"""

from __future__ import annotations

import torch

from ..core.intake import Intake
from ..core.kv_manager import KVBlockManager
from ..core.request import Request, RequestOutput
from ..core.scheduler import Scheduler, SchedulerOutput
from .beam import BeamGroup
from .sampling import Sample, sample_one, sample_rows, should_stop
from .speculative.verify import verify_step
from .stats import StepCounters


class Updater:
    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVBlockManager,
        intake: Intake,
        counters: StepCounters,
        generator: torch.Generator,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.intake = intake
        self.counters = counters
        self.generator = generator

    def apply(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        """The step ran: ``logits`` [num_sampled, vocab] float32, one row per request whose chunk
        reached the end of its known tokens, in scheduling order (speculating requests: all theirs)."""
        outputs: list[RequestOutput] = []
        if plan.num_lookahead_tokens:  # speculating requests are verified apart (speculative/verify.py)
            plan, logits, outputs = verify_step(self, plan, logits)
        for s in plan.scheduled:
            self.kv.commit(s.request, s.num_new_tokens)
        sampled = [s.request for s in plan.scheduled if s.request.num_computed_tokens == s.request.num_tokens]
        rows = [row for row, r in enumerate(sampled) if r.group is None]
        mine = logits if len(rows) == len(sampled) else logits[rows]  # no beams: no [rows, vocab] copy
        for row, sample in zip(rows, sample_rows(mine, [sampled[row] for row in rows], self.generator)):
            siblings = self._fork(sampled[row], logits[row : row + 1]) if sampled[row].children else []
            for r, s in [(sampled[row], sample), *siblings]:
                outputs += self._record(r, s, logits[row : row + 1])
        for row, beam in enumerate(sampled):  # a beam group moves once all its beams' logits are in
            if beam.group is not None and not beam.finished and beam.group.receive(beam, logits[row]):
                outputs += self._advance(beam.group)
        return outputs

    def fail(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The step raised: its requests fail (the engine goes on with the others)."""
        return [out for s in plan.scheduled for out in self.finish(s.request, "error", exc)]

    def finish(self, request: Request, reason: str, exc: Exception | None = None) -> list[RequestOutput]:
        """Finish ``request`` (and the siblings it has yet to fork), free its blocks, emit its final output."""
        if request.group is not None:  # a beam: the whole search ends, reported on its head
            request = request.group.head
            request.group.drop(self.scheduler)
        if request.finished:
            return []
        outputs = []
        for r in [request, *request.children]:
            r.finish(reason, f"{type(exc).__name__}: {exc}" if exc is not None else None)
            self.scheduler.remove(r)
            outputs.append(self._emit(r))
        request.children = []
        return outputs

    # ----------------------------------------------------------------------------- per request
    def _record(self, request: Request, sample: Sample | Exception, logits: torch.Tensor) -> list[RequestOutput]:
        """Record ``sample`` on ``request``, finish it if it should stop; its output of this step."""
        if isinstance(sample, Exception):
            return self.finish(request, "error", sample)
        request.append(sample.token, sample.scores, sample.logits, sample.logprob)
        self.counters.num_generated_tokens += 1
        try:
            stop = should_stop(request, logits)
        except Exception as exc:  # a caller's stopping criterion raised: that request fails alone
            return self.finish(request, "error", exc)
        if sample.token in request.sampling.eos_token_ids:
            return self.finish(request, "eos")
        if stop:
            return self.finish(request, "stop")
        if len(request.output_ids) >= request.max_new_tokens:
            return self.finish(request, "length")
        return [request.take_output()]

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[tuple[Request, Sample | Exception]]:
        """num_return_sequences: siblings share the parent's blocks (copy on write) and draw their
        own first token from the same logits."""
        forked = []
        for child in parent.children:
            if child.finished:  # aborted before its parent's prompt was computed
                continue
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            forked.append((child, sample_one(logits, child, self.generator)))
        parent.children = []
        return forked

    def _advance(self, group: BeamGroup) -> list[RequestOutput]:
        """A beam search step: the next beams fork their parents' blocks, or the search ends."""
        try:
            return [self._emit(r) for r in group.advance(self.kv, self.scheduler, self.generator)]
        except Exception as exc:  # e.g. a caller's processor or criterion: this request fails alone
            return self.finish(group.head, "error", exc)

    def _emit(self, request: Request) -> RequestOutput:
        """Final output of a finished request; the engine forgets it."""
        self.intake.forget(request)
        return request.take_output()
