"""What a step's tokens do to its requests: the third call of the engine's step (schedule, execute,
update), as vLLM's ``update_from_output``. It only descends: the sampler (``generation/sampler.py``)
decided every token; here they are recorded and the requests' blocks and lives follow.

In order: prompt log-probabilities are recorded; a speculating request's verified run is recorded token
by token and only its verified tokens are committed (the rest of its room trimmed); the other requests'
computed tokens are committed to the KV-block manager (full blocks enter the prefix cache, blocks that
left a window are freed); ``num_return_sequences`` siblings are forked (sharing their parent's blocks)
after the prompt's first sample; each token is recorded with its scores and log-probs and the request
finished where one rule says so (``_finish_reason``: the grammar, the stopping criteria, EOS, the length
limit); beam groups fork their next beams or end, and the rows of a lockstep batch are recorded as their
batch decided. A finished request's blocks go back at once, and the engine forgets it. One request's
failure (a caller's processor or criterion that raised) finishes that request alone with
``finish_reason="error"`` (a lockstep batch fails as one, as ``generate`` would).
"""

from __future__ import annotations

import torch

from ..core.intake import Intake
from ..core.kv_manager import KVBlockManager
from ..core.request import Request, RequestOutput
from ..core.scheduler import Scheduler, SchedulerOutput
from .generation.beam import BeamGroup
from .generation.lockstep import Lockstep, LockstepStep
from .generation.sampler import Drawn, StepOutput
from .generation.sampling import should_stop
from .stats import StepCounters


class Updater:
    def __init__(self, scheduler: Scheduler, kv: KVBlockManager, intake: Intake, counters: StepCounters) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.intake = intake
        self.counters = counters
        self.ready: list[Lockstep] = []  # lockstep batches a finish left with every live row's logits in
        self._recording: Lockstep | None = None

    def update(self, plan: SchedulerOutput, output: StepOutput) -> list[RequestOutput]:
        """The step ran and its sampler decided ``output``: record it on the plan's requests."""
        for request, logprobs in output.prompt_logprobs:
            request.prompt_logprobs += logprobs
        outputs: list[RequestOutput] = []
        for drawn in output.verified:  # committed token by token, as far as verified
            outputs += self._record(drawn)
        for s in plan.scheduled:
            if not s.draft_ids:
                self.kv.commit(s.request, s.num_new_tokens)
        for drawn in output.drawn:  # forks before any parent records (and may finish, releasing its blocks)
            if drawn.parent is not None:
                self._fork(drawn.parent, drawn.request)
        for drawn in output.drawn:
            if drawn.parent is None:
                drawn.request.children = []  # forked: each finishes on its own from now on
        for drawn in output.drawn:
            outputs += self._record(drawn)
        for unit, result in output.advanced:
            if isinstance(unit, BeamGroup):
                outputs += self._advance_beams(unit, result)
            else:
                outputs += self._record_lockstep(unit, result)
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
            r.finish(reason, exc)
            self.scheduler.remove(r)
            outputs.append(self._emit(r))
        request.children = []
        batch = request.sampling.lockstep
        if batch is not None and batch is not self._recording and batch.ready() and batch not in self.ready:
            self.ready.append(batch)  # it waited on this row: the engine has its sampler move it
        return outputs

    def take_ready(self) -> list[Lockstep]:
        ready, self.ready = self.ready, []
        return ready

    # ----------------------------------------------------------------------------- per request
    def _record(self, drawn: Drawn) -> list[RequestOutput]:
        """Record a request's new tokens, finishing it at the first that ends it; its output of this step.
        A verified run commits its tokens here: only those up to where it ends, the rest of its room trimmed."""
        request, samples = drawn.request, drawn.samples
        if isinstance(samples, Exception):
            return self.finish(request, "error", samples)
        num_accepted = len(samples) - 1 if drawn.num_drafted else 0
        if drawn.num_drafted:
            if request.speculation is not None:
                request.speculation.observe(drawn.num_drafted, num_accepted)
            self.counters.num_draft_tokens += drawn.num_drafted
        for i, sample in enumerate(samples):
            request.append(sample.token, sample.scores, sample.logits, sample.logprob)
            self.counters.num_generated_tokens += 1
            self.counters.num_accepted_tokens += int(i < num_accepted)
            reason = _finish_reason(request, sample.token, drawn.logits, drawn.first + i)
            if reason is not None:
                if drawn.num_drafted:
                    self.kv.commit(request, i + 1)  # t0 and the proposals before this token: all verified
                return self.finish(request, *reason)
        if drawn.num_drafted:
            self.kv.commit(request, len(samples))
            self.kv.trim(request)
        return [] if request.final_only else [request.take_output()]

    def _fork(self, parent: Request, child: Request) -> None:
        """num_return_sequences: a sibling shares its parent's blocks (copy on write) from its first token."""
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)

    def _record_lockstep(self, batch: Lockstep, step: LockstepStep | Exception) -> list[RequestOutput]:
        """A lockstep batch's step: the siblings of ``num_return_sequences`` forked at the first step, each
        row's token recorded, the rows that stopped finished."""
        self._recording = batch
        try:
            if isinstance(step, Exception):  # a caller's processor or criterion raised: the batch fails
                return [out for r in batch.live_requests() for out in self.finish(r, "error", step)]
            for parent, child in step.forks:
                self._fork(parent, child)
                parent.children = []  # forked: each finishes on its own from now on
            outputs = []
            for request, sample, reason in step.rows:
                request.append(sample.token, sample.scores, sample.logits, sample.logprob)
                self.counters.num_generated_tokens += 1
                outputs += self.finish(request, reason) if reason else [request.take_output()]
            return outputs
        finally:
            self._recording = None

    def _advance_beams(self, group: BeamGroup, decided: bool | Exception) -> list[RequestOutput]:
        """A beam search step: the next beams fork their parents' blocks, or the search ends."""
        try:
            if isinstance(decided, Exception):
                raise decided
            if decided:
                return [self._emit(r) for r in group.finish(self.scheduler)]
            group.reorder(self.kv, self.scheduler)
            return []
        except Exception as exc:  # e.g. a caller's processor or criterion: this request fails alone
            return self.finish(group.head, "error", exc)

    def _emit(self, request: Request) -> RequestOutput:
        """Final output of a finished request; the engine forgets it."""
        self.intake.forget(request)
        return request.take_output()


def _finish_reason(
    request: Request, token: int, logits: torch.Tensor, row: int
) -> tuple[str, Exception | None] | None:
    """Why ``request`` ends at its newest token ``token`` (row ``row`` of the step's raw ``logits`` [rows, vocab]
    is what its stopping criteria see), or None: the one rule for every token but a lockstep batch's (whose
    caller's criteria run on the whole batch, ``lockstep.py``)."""
    matcher = request.matcher
    if matcher is not None and not matcher.accept(token):
        return "error", ValueError(matcher.error or f"token {token} does not match the grammar")
    try:
        stop = bool(request.sampling.stopping) and should_stop(request, logits[row : row + 1])
    except Exception as exc:  # a caller's stopping criterion raised: that request fails alone
        return "error", exc
    if token in request.sampling.eos_token_ids:
        return "eos", None
    if stop or (matcher is not None and matcher.is_terminated()):  # a complete match
        return "stop", None
    if len(request.output_ids) >= request.max_new_tokens:
        return "length", None
    return None
