"""How many tokens each request proposes at a step: never more than pays for itself.

Cost: a forward of ``N`` tokens costs about ``overhead + N + switch * [the step verifies]``, in
units of its per-token cost. ``overhead`` is the part a step pays whatever its size (launches,
weights read once, Python): large where a forward is bound by reading the weights (a GPU, a small
model), small where it is compute-bound. ``switch``: a step with proposals is no plain decode step
(the varlen path instead of the decode kernel; on a GPU, an eager forward instead of a CUDA graph's
replay); on the CPU it grows with the batch. The defaults, per device, are in ``speculator.py``.

Gain: a request emits its ``j``-th proposal when the first ``j`` are all accepted: with ``f`` the
chance that its first proposal is accepted and ``c`` the chance that one after an accepted one is
too, with probability ``f * c**(j - 1)``. The two differ: a prompt lookup's continuation is often
wrong from its first token, but once its first token is right the rest tends to follow (on the
bundled model's own greedy text, ``f`` 0.35 and ``c`` 0.74). ``Acceptance`` estimates both per
request from what its verifications accepted, with a decay (it follows the text).

A new request starts from what the engine's requests have accepted so far (``Acceptance.like``),
so a good draft is trusted at once and a poor one is not tried on every newcomer.

Probes: a request the allocation gives nothing is probed now and then, whatever its estimate
says: as soon as it can (nothing is known of it yet), then after 8, 16, 32, ... steps without a
verification while its probes keep failing (up to 32 for prompt lookup, whose proposals cost nothing
to make and whose hits come in bursts; 256 for a draft model). In a batch of up to
``PROBE_ANY_BATCH`` a probe proposes what it can, at any step; in a bigger one only a request's
first probe runs, one token, in steps that verify anyway or one step in ``PROBE_STEP``, for a quarter
of the batch at most, so a big batch pays for them rarely (the engine-wide estimate they feed
decides for the others). A draft model only probes requests it ran for lately (``speculator.py``): it
would first have to run on every token since.

``allocate`` gives the step's proposal slots, one at a time, to the request whose next proposal is
worth the most, while that worth exceeds what the step's tokens earn per unit of cost: adding a
slot of gain ``g`` and cost ``w`` to a step that emits ``E`` tokens at cost ``T`` pays iff
``(E + g) / (T + w) > E / T``, i.e. ``g * T > E * w``; then the whole set must beat the plain step,
switch included, by ``MARGIN``. A draft model adds to a slot its own share of the draft's forward
(``slot_cost``) and to the step one forward of the draft per round (``round_cost``). A batch
of ``B`` decodes starts at ``E = B``, ``T = overhead + B``: at batch 1 a proposal pays when its
gain exceeds ``1 / (overhead + 1)``, at a batch far above ``overhead`` only when it is near 1, so a
big batch stops speculating by itself.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

PRIOR = (0.5, 0.7)  # what a request's first proposals are assumed to earn: (first, continued)
PRIOR_WEIGHT = 2.0  # in verifications
DECAY = 0.9  # weight of the past at each verification (about the last 10 count)
PROBE_FIRST = 8  # steps without verification before a probe, doubled while probes fail
PROBE_STEP = 16  # in a big batch, probes that no verify step takes along wait for one step in this many
PROBE_ANY_BATCH = 2  # in a batch this small, a probe runs at any step and proposes what it can
# What speculation must earn over plain decoding to be tried: a fixed batch runs in lockstep, so the
# tokens a few requests gain shorten the batch only at its end, worth less than the model says
MARGIN = 0.1


@dataclass(slots=True)
class Acceptance:
    """Decayed counts of one request's proposals accepted and rejected, first and continued ones,
    and when it is due for a probe."""

    counts: list[float] = field(
        default_factory=lambda: [PRIOR[0] * PRIOR_WEIGHT, (1 - PRIOR[0]) * PRIOR_WEIGHT,
                                 PRIOR[1] * PRIOR_WEIGHT, (1 - PRIOR[1]) * PRIOR_WEIGHT]
    )  # fmt: skip  # first accepted, first rejected, continued accepted, continued rejected
    idle_steps: int = 0  # decode steps since the last verification
    probe_after: int = 0  # idle steps before a probe: 0 until the first verification
    probe_max: int = 256  # the longest wait between probes

    @property
    def first(self) -> float:
        """Chance that the first proposal is accepted."""
        return self.counts[0] / (self.counts[0] + self.counts[1])

    @property
    def continued(self) -> float:
        """Chance that a proposal after an accepted one is accepted too."""
        return self.counts[2] / (self.counts[2] + self.counts[3])

    @property
    def probe_due(self) -> bool:
        return self.idle_steps >= self.probe_after

    @classmethod
    def like(cls, other: Acceptance, probe_max: int = 256) -> Acceptance:
        """A new estimate with ``other``'s rates, weighing as much as the prior."""
        f, c = other.first, other.continued
        counts = [f * PRIOR_WEIGHT, (1 - f) * PRIOR_WEIGHT, c * PRIOR_WEIGHT, (1 - c) * PRIOR_WEIGHT]
        return cls(counts, probe_max=probe_max)

    def gain(self, j: int) -> float:
        """The expected tokens the ``j``-th proposal (from 1) adds."""
        return self.first * self.continued ** (j - 1)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """A verification of ``num_proposed`` tokens accepted the first ``num_accepted``."""
        outcome = (
            float(num_accepted >= 1),
            float(num_accepted == 0),
            float(max(num_accepted - 1, 0)),
            float(1 <= num_accepted < num_proposed),
        )
        self.counts = [DECAY * c + o for c, o in zip(self.counts, outcome)]
        self.probe_after = PROBE_FIRST if num_accepted else min(max(2 * self.probe_after, PROBE_FIRST), self.probe_max)
        self.idle_steps = 0

    def idle(self) -> None:
        """A decode step without verification."""
        self.idle_steps += 1


def allocate(
    rates: list[tuple[float, float]],
    limits: list[int],
    overhead: float,
    num_decoding: int,
    switch: float = 0.0,
    round_cost: float = 0.0,
    slot_cost: float = 0.0,
) -> list[int]:
    """Proposal slots per request, at most ``limits[i]`` for request i of acceptance ``rates[i]``
    (first, continued), in a step of ``num_decoding`` decodes (the speculating requests among
    them) whose forward costs ``overhead + tokens``, ``switch`` more if it verifies any proposal.
    A draft model adds ``slot_cost`` per proposal and ``round_cost`` per round (one forward of it):
    the slots are chosen as if rounds were free, then cut to the number of rounds that pays best."""
    plain = num_decoding / (overhead + num_decoding)  # tokens per unit of cost without speculation
    emitted, cost = float(num_decoding), overhead + num_decoding + switch
    ks = [0] * len(rates)
    gains: list[list[float]] = [[] for _ in rates]  # gains[i][j]: what request i's slot j + 1 earns
    heap = [(-first, i) for i, ((first, _), limit) in enumerate(zip(rates, limits)) if limit > 0 and first > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        if gain * cost <= emitted * (1 + slot_cost):  # does not pay; nor will a smaller gain
            break
        emitted, cost, ks[i] = emitted + gain, cost + 1 + slot_cost, ks[i] + 1
        gains[i].append(gain)
        if ks[i] < limits[i]:
            heapq.heappush(heap, (-gain * rates[i][1], i))
    best, best_rounds = plain * (1 + MARGIN), 0
    for rounds in range(1, max(ks, default=0) + 1):
        slots = [min(k, rounds) for k in ks]
        earned = num_decoding + sum(sum(g[:n]) for g, n in zip(gains, slots))
        spent = overhead + num_decoding + switch + sum(slots) * (1 + slot_cost) + rounds * round_cost
        if earned / spent > best:
            best, best_rounds = earned / spent, rounds
    return [min(k, best_rounds) for k in ks]
