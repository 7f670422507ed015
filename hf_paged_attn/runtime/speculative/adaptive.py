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

Probes: a request the allocation gives nothing is probed now and then, whatever its estimate says:
at its first decode step (nothing is known of it yet), then after 8, 16, 32, ... up to 256 steps
without a verification while its probes keep failing. Probes are gathered into steps that verify
anyway, or one step in ``PROBE_STEP``, so a big batch pays for a verify step rarely.

``allocate`` gives the step's proposal slots, one at a time, to the request whose next proposal is
worth the most, while that worth exceeds what the step's tokens earn per unit of cost: adding a
slot of gain ``g`` and cost ``w`` to a step that emits ``E`` tokens at cost ``T`` pays iff
``(E + g) / (T + w) > E / T``, i.e. ``g * T > E * w``; then the whole set must beat the plain step,
switch included. A slot costs its verify row, and for a draft model that must run one more round
for it, that round's forward too (``round_cost``). A batch
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
PROBE_FIRST, PROBE_MAX = 8, 256  # steps without verification before a probe, doubled while probes fail
PROBE_STEP = 16  # probes that no verify step takes along wait for one step in this many


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
        self.probe_after = PROBE_FIRST if num_accepted else min(max(2 * self.probe_after, PROBE_FIRST), PROBE_MAX)
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
) -> list[int]:
    """Proposal slots per request, at most ``limits[i]`` for request i of acceptance ``rates[i]``
    (first, continued), in a step of ``num_decoding`` decodes (the speculating requests among
    them) whose forward costs ``overhead + tokens``, ``switch`` more if it verifies any proposal,
    and ``round_cost`` more for each round of proposals (a draft model's forwards)."""
    plain = num_decoding / (overhead + num_decoding)  # tokens per unit of cost without speculation
    emitted, cost, rounds = float(num_decoding), overhead + num_decoding + switch, 0
    ks = [0] * len(rates)
    heap = [(-first, i) for i, ((first, _), limit) in enumerate(zip(rates, limits)) if limit > 0 and first > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        extra = 1 + (round_cost if ks[i] == rounds else 0)  # its row, and a new round of the draft
        if gain * cost <= emitted * extra:  # does not pay; nor will a smaller gain
            if extra > 1:
                continue  # a slot of another request within the rounds already paid for may
            break
        emitted, cost, ks[i] = emitted + gain, cost + extra, ks[i] + 1
        rounds = max(rounds, ks[i])
        if ks[i] < limits[i]:
            heapq.heappush(heap, (-gain * rates[i][1], i))
    return ks if emitted / cost > plain else [0] * len(rates)
