"""``Speculator``: the engine's speculative decoding, in two calls around the scheduler.

- ``plan(running)``, before ``Scheduler.schedule``: each decoding request that speculates gets its
  ``lookahead`` for the step (``adaptive.allocate``: what pays at this batch size and acceptance;
  never past ``max_new_tokens``); prompt lookup proposes at once, so its lookahead is exactly its
  proposal's length.
- ``propose(plan)``, right after it and still part of scheduling: the plan with the proposals of the
  scheduled requests, cut to the room the scheduler reserved (it may grant less, or nothing: then the
  request decodes as usual); the draft model runs here. The plan it returns is final.

Verification is ``verify.py``, in the sampler (``generation/sampler.py``); the updater records what it
accepted. A request speculates when its own generation
config asks (``prompt_lookup_num_tokens``) or the engine's ``PagedConfig.speculative`` does, and it
is not a beam search, a row of ``generate``'s lockstep batch (a caller's processors) or a constrained
request, and every step of its processor plan leaves the ids alone (temperature, top-k, top-p,
min-p, typical, epsilon): verification runs them on ``k + 1`` rows at once, which a processor that
reads the history, or one of the caller's, would see out of order. Other requests decode as
usual beside the speculating ones.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from ...core.kv_manager import KVBlockManager
from ...core.layers import LayerKinds
from ...core.request import Request, Status
from ...core.scheduler import ScheduledRequest, SchedulerOutput
from ...kernels.base import AttentionBackend
from .adaptive import PROBE_ANY_BATCH, PROBE_STEP, Acceptance, allocate
from .config import METHODS, RequestSpeculation, SpeculativeConfig, request_speculation
from .draft import DraftProposer
from .ngram import NgramIndex

logger = logging.getLogger(__name__)

# What a step costs besides its tokens, and what verifying costs besides its rows (fixed, and per
# decoding request), in tokens of the forward's per-token cost (adaptive.py). CPU: measured on the
# bundled model, whole steps (benchmarks/speculative.py): a decode step of 1 request 2.7 ms, +0.15 ms
# a row, +0.2 ms to verify; of 16 requests 6.0 ms, +0.45 ms to verify. GPU: a decode step replayed
# from a CUDA graph against an eager verify step, guessed for a model of a few billion parameters
# (not measured here: set SpeculativeConfig.step_overhead_tokens / switch_cost_tokens).
DEFAULT_COSTS = {"cpu": (18.0, 1.0, 0.15), "cuda": (128.0, 32.0, 0.0)}
# A draft model is not probed for a request it would first have to run on more tokens than this
MAX_PROBE_CATCH_UP = 16


@dataclass(slots=True)
class SpecState:
    """One request's speculative decoding: what it asked for, its acceptance, its proposer's state."""

    settings: RequestSpeculation
    acceptance: Acceptance = field(default_factory=Acceptance)
    ngram: NgramIndex | None = None
    draft_computed: int = 0  # positions the draft model has fed (its K/V), of this request's current blocks
    preemptions: int = 0  # the request's num_preemptions when draft_computed was last valid
    q: torch.Tensor | None = None  # [k, vocab]: the draft's probabilities of this step's proposals (sampling)
    shared: Acceptance | None = None  # the engine's estimate over all requests of this method

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.acceptance.observe(num_proposed, num_accepted)
        if self.shared is not None:
            self.shared.observe(num_proposed, num_accepted)

    def draft_start(self, request: Request) -> int:
        """Where the draft model resumes: what it fed that the target kept (a preemption freed it all)."""
        if request.num_preemptions != self.preemptions:
            self.preemptions, self.draft_computed = request.num_preemptions, 0
        return min(self.draft_computed, request.num_computed_tokens)


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig | None,
        kv: KVBlockManager,
        draft: DraftProposer | None,
        device: torch.device,
        generator: torch.Generator,
    ) -> None:
        self.config = config
        self.kv = kv
        self.draft = draft
        self.generator = generator
        overhead, switch, per_request = DEFAULT_COSTS.get(device.type, DEFAULT_COSTS["cuda"])
        if config is not None and config.step_overhead_tokens is not None:
            overhead = config.step_overhead_tokens
        if config is not None and config.switch_cost_tokens is not None:
            switch, per_request = config.switch_cost_tokens, 0.0
        self.overhead, self.switch, self.switch_per_request = overhead, switch, per_request
        self.adaptive = config.adaptive if config is not None else True
        # A draft model's costs against the target's: one of its forwards (a round) and one of its
        # tokens. Both models' forward costs go mostly per layer, plus about a layer's for the rest
        # (embedding, head, the model call): on the CPU, the bundled model drafting for itself
        # deepened to 16 layers measures 5.2 tokens a round and 0.4 a token (ratio 5/17 here).
        ratio = (draft.num_layers + 1) / (draft.target_layers + 1) if draft is not None else 0.0
        self.round_cost, self.slot_cost = ratio * overhead, ratio
        self.num_steps = 0
        self.shared = {method: Acceptance() for method in METHODS}  # every request's verifications, per method
        self._warned: set[str] = set()

    def close(self) -> None:
        """Take what the draft model got from the engine off it (``DraftProposer.close``). Idempotent."""
        if self.draft is not None:
            self.draft.close()

    # ----------------------------------------------------------------------------- before scheduling
    def plan(self, running: list[Request]) -> None:
        """Set each running request's ``lookahead`` (and prompt lookup's ``draft_ids``) for the step."""
        candidates: list[tuple[Request, SpecState]] = []
        limits: list[int] = []
        num_decoding = 0
        for request in running:
            if request.lookahead or request.draft_ids:  # last step's, not granted
                request.lookahead, request.draft_ids = 0, []
            if request.num_pending_tokens != 1 or request.status is not Status.RUNNING:
                continue
            num_decoding += 1
            state = request.speculation
            if state is None:
                state = request.speculation = self._state_for(request)
            if not state:
                continue
            limit = min(state.settings.k, request.max_new_tokens - len(request.output_ids) - 1)
            if limit > 0:
                candidates.append((request, state))
                limits.append(limit)
        self.num_steps += 1
        if not candidates:
            return
        if self.adaptive:  # first as if every proposal came out whole: lookups only where a slot may pay
            limits = self._allocate(candidates, limits, num_decoding)
        shortened = False
        for i, (request, state) in enumerate(candidates):
            if limits[i] and state.ngram is not None:
                state.ngram.extend(request)
                request.draft_ids = state.ngram.propose(limits[i], request.sampling.eos_token_ids)
                shortened = shortened or len(request.draft_ids) < limits[i]
                limits[i] = len(request.draft_ids)
        if shortened and self.adaptive:  # the slots of proposals that came out short go to the others
            limits = self._allocate(candidates, limits, num_decoding)
        for (request, state), k in zip(candidates, limits):
            request.lookahead = k
            if state.ngram is not None:
                request.draft_ids = request.draft_ids[:k]
            if not k:
                state.acceptance.idle()

    def _allocate(self, candidates: list[tuple[Request, SpecState]], limits: list[int], num_decoding: int) -> list[int]:
        """``adaptive.allocate``'s slots, and probes for the requests due one (``adaptive.py``)."""
        rates = [(state.acceptance.first, state.acceptance.continued) for _, state in candidates]
        switch = self.switch + self.switch_per_request * num_decoding
        best = max(first for first, _ in rates)
        if best * (self.overhead + num_decoding + switch) > num_decoding * (1 + self.slot_cost):
            ks = allocate(rates, limits, self.overhead, num_decoding, switch, self.round_cost, self.slot_cost)
        else:  # not even the best first proposal pays (the common case in a big batch)
            ks = [0] * len(candidates)
        small = num_decoding <= PROBE_ANY_BATCH
        if small or any(ks) or self.num_steps % PROBE_STEP == 0:
            due = [
                i for i, (r, state) in enumerate(candidates)
                if not ks[i] and (small or not state.acceptance.probe_after) and self._probe_ok(r, state)
            ]  # fmt: skip
            due.sort(key=lambda i: -candidates[i][1].acceptance.idle_steps)
            for i in due[: max(1, num_decoding // 4)]:
                ks[i] = limits[i] if small else min(limits[i], 1)
        return ks

    @staticmethod
    def _probe_ok(request: Request, state: SpecState) -> bool:
        """Due a probe, and cheap to probe: a draft model would first have to catch up on every
        token since it last ran (the whole sequence, for a request it never ran for)."""
        if not state.acceptance.probe_due:
            return False
        return state.ngram is not None or request.num_tokens - state.draft_start(request) <= MAX_PROBE_CATCH_UP

    def _state_for(self, request: Request) -> SpecState | bool:
        """A request's state, or False when it does not speculate (checked once per request)."""
        params = request.sampling
        settings = request_speculation(params.generation_config, self.config)
        if settings is None or not settings.k:
            return False
        reason = None
        if request.group is not None:
            reason = "beam search"
        elif params.lockstep is not None:
            reason = "a caller's processors or criteria run on generate's whole batch"
        elif request.matcher is not None:
            reason = "structured outputs"
        elif params.plan.tail_start:  # a step before the row-free tail reads the ids (or is the caller's)
            kinds = sorted({type(step).__name__ for step in params.plan.steps[: params.plan.tail_start]})
            reason = f"logits processors that read the ids ({', '.join(kinds)})"
        elif settings.method == "draft" and self.draft is None:
            reason = "no draft model"
        if reason is not None:
            if reason not in self._warned:
                self._warned.add(reason)
                logger.warning("requests with %s decode without speculation", reason)
            return False
        ngram = NgramIndex(settings.ngram_size) if settings.method == "ngram" else None
        shared = self.shared[settings.method]
        acceptance = Acceptance.like(shared, probe_max=32 if ngram is not None else 256)
        return SpecState(settings, acceptance=acceptance, ngram=ngram, shared=shared)

    # ----------------------------------------------------------------------------- the plan's last word
    def propose(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The scheduler's ``plan`` with each scheduled request's proposals (``ScheduledRequest.draft_ids``),
        cut to the room the scheduler reserved; where a proposal came out shorter than its room, the
        request feeds fewer tokens and the unused room is given back. Part of scheduling: the plan it
        returns is the step's, and nothing changes it after."""
        if self.draft is not None and plan.block_copies:
            self.draft.copy_blocks(plan.block_copies)
        for request in plan.preempted:
            request.lookahead, request.draft_ids = 0, []
        if not plan.num_lookahead_tokens:
            return plan
        to_draft: list[tuple[Request, int]] = []
        for s in plan.scheduled:
            request = s.request
            granted = s.num_new_tokens - request.num_pending_tokens
            if granted <= 0:
                request.draft_ids = []
            elif request.speculation.ngram is None:
                to_draft.append((request, granted))
            else:
                request.draft_ids = request.draft_ids[:granted]
        if to_draft:
            self.draft.propose(to_draft, self.generator)
        scheduled = []
        for s in plan.scheduled:
            request = s.request
            fed = request.num_pending_tokens + len(request.draft_ids)
            if s.num_new_tokens > fed:  # the proposal came out shorter than its room
                self.kv.trim(request, request.num_computed_tokens + fed)
            scheduled.append(ScheduledRequest(request, min(s.num_new_tokens, fed), tuple(request.draft_ids)))
            request.draft_ids = []  # the plan holds them now
        return dataclasses.replace(plan, scheduled=scheduled)


def build_speculator(
    model: torch.nn.Module,
    config: SpeculativeConfig | None,
    kv: KVBlockManager,
    layers: LayerKinds,
    num_pages: int,
    backend: AttentionBackend,
    max_batch_tokens: int,
    device: torch.device,
    generator: torch.Generator,
) -> Speculator:
    """The engine's speculator; with ``config.draft_model``, its draft model's cache of ``num_pages``
    pages (as many as the target's) addressed by the target's blocks."""
    draft = None
    if config is not None and config.draft_model is not None:
        draft = DraftProposer(config.draft_model, model, layers, num_pages, kv.block_size, backend, max_batch_tokens)
    return Speculator(config, kv, draft, device, generator)
