"""What a step's logits do to its requests: the third call of the engine's step (schedule, execute,
update), as vLLM's ``update_from_output``.

In order: the computed tokens are committed to the KV-block manager (full blocks enter the prefix
cache, blocks that left a window are freed); each request whose chunk reached its end samples its
next token (stacked where requests share their sampling, ``sampling.py``; processors that read the
ids read them from one ``TokenHistory``, which gets the step's tokens in one append);
``num_return_sequences`` siblings are forked after the prompt's first sample; the token is recorded
with its scores and log-probs; EOS, the stopping criteria and the length limit finish requests;
beam groups advance once all their beams' logits are in, and so do the rows of a lockstep batch
(``lockstep.py``: a ``model.generate`` call whose caller's processors or criteria see the whole
batch). A finished request's blocks go back at once, and the engine forgets it. One request's
failure (a caller's processor or criterion that raises) finishes that request alone with
``finish_reason="error"`` (a lockstep batch fails as one, as ``generate`` would).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.intake import Intake
from ..core.kv_manager import KVBlockManager
from ..core.request import Request, RequestOutput
from ..core.scheduler import Scheduler, SchedulerOutput
from .generation.beam import BeamGroup
from .generation.lockstep import Lockstep
from .generation.processors import TokenHistory
from .generation.sampling import Sample, prompt_token_logprobs, sample_one, sample_rows, should_stop
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
        self.history: TokenHistory | None = None  # made on the logits' device at the first step
        self._advancing: Lockstep | None = None

    def apply(
        self, plan: SchedulerOutput, logits: torch.Tensor, scored: Sequence[tuple[int, range]] = ()
    ) -> list[RequestOutput]:
        """The step ran: ``logits`` [num_sampled, vocab] float32, one row per request whose chunk
        reached the end of its known tokens, in scheduling order (speculating requests: all theirs),
        then the rows of ``scored`` (``attention.step.prompt_scoring``: prompt tokens to score),
        which are recorded first."""
        outputs: list[RequestOutput] = []
        if scored:  # prompt_logprobs: their rows follow the sampled ones (attention/step.py)
            num_rows = sum(len(positions) for _, positions in scored)
            self._score_prompts(plan, scored, logits[logits.shape[0] - num_rows :])
            logits = logits[: logits.shape[0] - num_rows]
        if plan.num_lookahead_tokens:  # speculating requests are verified apart (speculative/verify.py)
            plan, logits, outputs = verify_step(self, plan, logits)
        if self.history is None:
            self.history = TokenHistory(logits.device)
        for s in plan.scheduled:
            self.kv.commit(s.request, s.num_new_tokens)
        sampled = [s.request for s in plan.scheduled if s.request.num_computed_tokens == s.request.num_tokens]
        rows = [row for row, r in enumerate(sampled) if r.group is None and r.sampling.lockstep is None]
        constrained = [row for row in rows if sampled[row].matcher is not None]
        if constrained:  # grammar masks first: processors, sampling and forks see only allowed tokens
            from .generation.structured import mask_rows

            mask_rows(logits, [sampled[row].matcher for row in constrained], constrained)
        mine = logits if len(rows) == len(sampled) else logits[rows]  # no groups: no [rows, vocab] copy
        drawn = []  # (request, its sample, its logits row)
        for row, sample in zip(rows, sample_rows(mine, [sampled[row] for row in rows], self.generator, self.history)):
            siblings = self._fork(sampled[row], logits[row : row + 1]) if sampled[row].children else []
            drawn += [(r, s, logits[row : row + 1]) for r, s in [(sampled[row], sample), *siblings]]
        # One append of the step's tokens to every tracked row, before any of them finishes and is released
        tracked = [(r, s.token) for r, s, _ in drawn if isinstance(s, Sample) and r in self.history]
        self.history.append([r for r, _ in tracked], [t for _, t in tracked])
        for r, s, row_logits in drawn:
            outputs += self._record(r, s, row_logits)
        for row, request in enumerate(sampled):  # groups move once all their members' logits are in
            if request.finished:
                continue
            if request.group is not None and request.group.receive(request, logits[row]):
                outputs += self._advance(request.group)
            elif request.sampling.lockstep is not None and request.sampling.lockstep.receive(request, logits[row]):
                outputs += self._advance_lockstep(request.sampling.lockstep)
        return outputs

    def fail(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The step raised: its requests fail (the engine goes on with the others)."""
        return [out for s in plan.scheduled for out in self.finish(s.request, "error", exc)]

    @torch.inference_mode()  # an abort comes from outside the step: the rows' tensors are inference tensors
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
            if self.history is not None:
                self.history.release(r)
            outputs.append(self._emit(r))
        request.children = []
        batch = request.sampling.lockstep
        if batch is not None and batch is not self._advancing and batch.ready():  # it waited on this row
            outputs += self._advance_lockstep(batch)
        return outputs

    # ----------------------------------------------------------------------------- per request
    @staticmethod
    def _score_prompts(plan: SchedulerOutput, scored: Sequence[tuple[int, range]], logits: torch.Tensor) -> None:
        """Record the prompt log-probabilities of the step's scoring rows ``logits`` [rows, vocab]."""
        row = 0
        for i, positions in scored:
            request = plan.scheduled[i].request
            assert request.prompt_logprobs is not None and request.num_prompt_logprobs is not None
            tokens = request.prompt_ids[positions.start + 1 : positions.stop + 1]  # position p scores token p + 1
            rows = logits[row : row + len(positions)]
            request.prompt_logprobs += prompt_token_logprobs(rows, tokens, request.num_prompt_logprobs)
            row += len(positions)

    def _record(self, request: Request, sample: Sample | Exception, logits: torch.Tensor) -> list[RequestOutput]:
        """Record ``sample`` on ``request``, finish it if it should stop; its output of this step."""
        if isinstance(sample, Exception):
            return self.finish(request, "error", sample)
        request.append(sample.token, sample.scores, sample.logits, sample.logprob)
        self.counters.num_generated_tokens += 1
        if request.matcher is not None and not request.matcher.accept(sample.token):
            error = request.matcher.error or f"token {sample.token} does not match the grammar"
            return self.finish(request, "error", ValueError(error))
        try:
            stop = should_stop(request, logits)
        except Exception as exc:  # a caller's stopping criterion raised: that request fails alone
            return self.finish(request, "error", exc)
        if sample.token in request.sampling.eos_token_ids:
            return self.finish(request, "eos")
        if stop or (request.matcher is not None and request.matcher.is_terminated()):  # a complete match
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
            if parent in self.history:  # before the parent's first token is appended
                self.history.fork(parent, child)
            forked.append((child, sample_one(logits, child, self.generator, self.history)))
        parent.children = []
        return forked

    def _advance_lockstep(self, batch: Lockstep) -> list[RequestOutput]:
        """Every live row of a lockstep batch has its logits: the caller's processors run once on
        the batch, each row draws, the siblings of ``num_return_sequences`` are forked at the
        first step, the criteria run once on the batch; rows that stopped finish."""
        self._advancing = batch
        try:
            step = batch.advance(self.generator)
        except Exception as exc:  # a caller's processor or criterion raised: the batch fails, as generate would
            outputs = [out for r in batch.live_requests() for out in self.finish(r, "error", exc)]
            self._advancing = None
            return outputs
        for parent, child in step.forks:
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            parent.children = []  # forked: each finishes on its own from now on
        outputs = []
        for request, sample, reason in step.rows:
            request.append(sample.token, sample.scores, sample.logits, sample.logprob)
            self.counters.num_generated_tokens += 1
            outputs += self.finish(request, reason) if reason else [request.take_output()]
        self._advancing = None
        return outputs

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
