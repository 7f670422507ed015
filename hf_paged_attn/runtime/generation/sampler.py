"""The sampler: the executor's side of a step after the forward, as vLLM's ``Sampler`` in its model runner.
From the step's logits it decides every token and returns them (``StepOutput``); the updater records them.

What it decides, in this order (the order the engine's generator is drawn in, so seeded runs repeat):
prompt log-probabilities of the scoring rows; a speculating request's accepted proposals
(``speculative/verify.py``: greedy acceptance or rejection sampling); each request whose chunk reached
its end draws its token (grammar masks first, ``structured.py``; then its processors, stacked where
requests share them, ``sampling.py``), then the ``num_return_sequences`` siblings forked from it draw
theirs from the same row; beam groups (``beam.py``) and the rows of a ``model.generate`` batch
(``lockstep.py``) decide once every member's row is in. It changes no request's tokens, blocks or state
in the scheduler: those are the updater's.

Processors that read the ids read them from one ``TokenHistory``, which gets the step's tokens in one
append; a finished request's row is released at the sampler's next step (the updater never reaches back
here), as vLLM's workers free a finished request's state at the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...core.request import Request, TokenLogprob
from ...core.scheduler import SchedulerOutput
from ..speculative.verify import verify
from .argmax import row_argmax
from .beam import BeamGroup
from .lockstep import Lockstep, LockstepStep
from .processors import TokenHistory
from .sampling import Sample, prompt_token_logprobs, sample_one, sample_rows

if TYPE_CHECKING:
    from .mask_prefill import MaskPrefill


@dataclass(slots=True)
class Drawn:
    """One request's new tokens: one, or a speculating request's verified run; or the exception its
    sampling raised (a caller's processor), which fails that request alone."""

    request: Request
    samples: list[Sample] | Exception
    # The step's raw rows; this request's are ``first`` .. ``first + len(samples) - 1``, what its stopping criteria
    # see (one, shared by siblings). Sliced only where read: a view a row a step was ~3 us of every decode step.
    logits: torch.Tensor  # [rows, vocab]
    first: int = 0
    num_drafted: int = 0  # proposals verified (a speculating request; 0 for the others)
    parent: Request | None = None  # a ``num_return_sequences`` sibling forked from ``parent`` at this token


@dataclass(slots=True)
class StepOutput:
    """What a step decided, for ``Updater.update``: token ids and what requests record with them, never logits
    to sample from. Each list is in the plan's order."""

    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)
    verified: list[Drawn] = field(default_factory=list)  # speculating requests
    drawn: list[Drawn] = field(default_factory=list)  # the others, each followed by the siblings forked from it
    # beam groups (True: the search ended) and lockstep batches, as each received its last member's row
    advanced: list[tuple[BeamGroup | Lockstep, bool | LockstepStep | Exception]] = field(default_factory=list)
    sample_seconds: float = 0.0


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # the engine's: requests without their own seed draw from it
        self.history: TokenHistory | None = None  # made on the logits' device at the first step
        self.masks: MaskPrefill | None = None  # the next step's grammar masks, filled ahead (``prefill_masks``)

    def prefill_masks(self, requests: Sequence[Request]) -> None:
        """After a step's update: fill the grammar masks of ``requests`` (the running ones) that are constrained,
        for the next step, while the engine's Python runs (``mask_prefill.py``)."""
        matchers = [r.matcher for r in requests if r.matcher is not None and not r.finished]
        if matchers and self.masks is None:  # (imported at the first constrained request: llguidance is large)
            from .mask_prefill import MaskPrefill

            self.masks = MaskPrefill()
        if self.masks is not None:
            self.masks.start(matchers)

    def close(self) -> None:
        """Stop the mask-filling thread, if one was started."""
        if self.masks is not None:
            self.masks.close()

    def sample(
        self, plan: SchedulerOutput, logits: torch.Tensor, scored: Sequence[tuple[int, range]] = ()
    ) -> StepOutput:
        """The step's tokens. ``logits`` [num_sampled, vocab] float32: one row per request whose chunk
        reached the end of its known tokens, in the plan's order (a speculating request: its ``1 + k``),
        then the rows of ``scored`` (``attention.step.prompt_scoring``). Read before the plan is
        committed (``num_computed_tokens``: each chunk's start)."""
        # before anything here copies a matcher (forks) or the update advances them
        prefilled = self.masks.take() if self.masks is not None else None
        out = StepOutput()
        if self.history is None:
            self.history = TokenHistory(logits.device)
        self.release_finished()
        if scored:  # prompt_logprobs: their rows follow the sampled ones (attention/step.py)
            num_rows = sum(len(positions) for _, positions in scored)
            out.prompt_logprobs = _prompt_logprobs(plan, scored, logits[logits.shape[0] - num_rows :])
            logits = logits[: logits.shape[0] - num_rows]
        logits, sampled = self._verify(plan, logits, out)
        rows = [row for row, r in enumerate(sampled) if r.group is None and r.sampling.lockstep is None]
        constrained = [row for row in rows if sampled[row].matcher is not None]
        if constrained:  # grammar masks first: processors, sampling and forks see only allowed tokens
            from .mask_prefill import mask_rows

            mask_rows(logits, [sampled[row].matcher for row in constrained], constrained, prefilled)
        mine = logits if len(rows) == len(sampled) else logits[rows]  # no groups: no [rows, vocab] copy
        for row, sample in zip(rows, sample_rows(mine, [sampled[row] for row in rows], self.generator, self.history)):
            parent = sampled[row]
            out.drawn.append(Drawn(parent, _as_list(sample), logits, row))
            if parent.children:
                out.drawn += self._fork(parent, logits[row : row + 1])
        # One append of the step's tokens to every tracked row
        tracked = [(d.request, d.samples[0].token) for d in out.drawn
                   if isinstance(d.samples, list) and d.request in self.history]  # fmt: skip
        self.history.append([r for r, _ in tracked], [t for _, t in tracked])
        decided: set[int] = set()  # beam groups that decided this step: a row of their old beams is void
        for row, request in enumerate(sampled):  # groups move once all their members' rows are in
            if request.finished or (request.group is not None and id(request.group) in decided):
                continue
            if request.group is not None and request.group.receive(request, logits[row]):
                decided.add(id(request.group))
                out.advanced.append((request.group, self._decide(request.group)))
            elif request.sampling.lockstep is not None and request.sampling.lockstep.receive(request, logits[row]):
                out.advanced.append((request.sampling.lockstep, self.advance_lockstep(request.sampling.lockstep)))
        return out

    def advance_lockstep(self, batch: Lockstep) -> LockstepStep | Exception:
        """Every live row of ``batch`` has its logits: the caller's processors and criteria run on the batch
        (the exception of one that raised fails the batch, as ``generate`` would)."""
        try:
            return batch.advance(self.generator)
        except Exception as exc:
            return exc

    @torch.inference_mode()  # the history's rows are inference tensors
    def release_finished(self) -> None:
        """Give back the history rows of requests that finished since the last step."""
        if self.history is not None:
            for request in [r for r in self.history.slots if r.finished]:
                self.history.release(request)

    # ----------------------------------------------------------------------------- parts of a step
    def _verify(
        self, plan: SchedulerOutput, logits: torch.Tensor, out: StepOutput
    ) -> tuple[torch.Tensor, list[Request]]:
        """Verify the speculating requests (into ``out.verified``); returns the other rows' logits and
        their requests."""
        sampled: list[Request] = []
        rest_rows: list[int] = []
        runs = []  # (scheduled request, its first row)
        row = 0
        for s in plan.scheduled:
            request = s.request
            if s.draft_ids:
                assert s.num_new_tokens == 1 + len(s.draft_ids) and not request.children
                runs.append((s, row))
                row += 1 + len(s.draft_ids)
            elif request.num_computed_tokens + s.num_new_tokens == request.num_tokens:
                sampled.append(request)
                rest_rows.append(row)
                row += 1
        if not runs:
            return logits, sampled
        assert row == logits.shape[0], f"{row} rows expected, the step has {logits.shape[0]}"
        greedy = any(not s.request.sampling.needs_row_work for s, _ in runs)
        argmax = row_argmax(logits).tolist() if greedy else None
        for s, first in runs:
            k, raw = len(s.draft_ids), logits[first : first + 1 + len(s.draft_ids)]
            try:
                targets = argmax[first : first + k + 1] if argmax is not None else None
                samples: list[Sample] | Exception = verify(s.request, list(s.draft_ids), raw, targets, self.generator)
            except Exception as exc:  # e.g. a processor that raises: this request fails alone
                samples = exc
            out.verified.append(Drawn(s.request, samples, raw, num_drafted=k))
        index = torch.tensor(rest_rows, dtype=torch.long, device=logits.device)
        return logits.index_select(0, index), sampled

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[Drawn]:
        """``num_return_sequences``: the siblings draw their own first token from their parent's row."""
        forked = []
        for child in parent.children:
            if child.finished:  # aborted before its parent's prompt was computed
                continue
            if parent in self.history:  # before the parent's first token is appended
                self.history.fork(parent, child)
            sample = sample_one(logits, child, self.generator, self.history)
            forked.append(Drawn(child, _as_list(sample), logits, parent=parent))
        return forked

    def _decide(self, group: BeamGroup) -> bool | Exception:
        """One beam search step on the group's rows: True when the search is over."""
        try:
            return group.decide(group.params.generator or self.generator)
        except Exception as exc:  # e.g. a caller's processor or criterion: this request fails alone
            return exc


def _as_list(sample: Sample | Exception) -> list[Sample] | Exception:
    return sample if isinstance(sample, Exception) else [sample]


def _prompt_logprobs(
    plan: SchedulerOutput, scored: Sequence[tuple[int, range]], logits: torch.Tensor
) -> list[tuple[Request, list[TokenLogprob]]]:
    """The prompt log-probabilities of the step's scoring rows ``logits`` [rows, vocab]."""
    out, row = [], 0
    for i, positions in scored:
        request = plan.scheduled[i].request
        assert request.prompt_logprobs is not None and request.num_prompt_logprobs is not None
        tokens = request.prompt_ids[positions.start + 1 : positions.stop + 1]  # position p scores token p + 1
        rows = logits[row : row + len(positions)]
        out.append((request, prompt_token_logprobs(rows, tokens, request.num_prompt_logprobs)))
        row += len(positions)
    return out
