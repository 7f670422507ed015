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
request, from what its verifications accepted, with a decay (it follows the text) and a drift back
to a prior while the request does not speculate, so a request that backed off to 0 is probed again
now and then.

``allocate`` gives the step's proposal slots, one at a time, to the request whose next proposal is
worth the most, while that worth exceeds what the step's tokens earn per unit of cost: adding a
slot of gain ``g`` to a step that emits ``E`` tokens at cost ``T`` pays iff ``(E + g) / (T + 1) >
E / T``, i.e. ``g * T > E``; then the whole set must beat the plain step, switch included. A batch
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
DRIFT = 0.1  # share of the way back to the prior per step without a verification


@dataclass(slots=True)
class Acceptance:
    """Decayed counts of one request's proposals accepted and rejected, first and continued ones."""

    counts: list[float] = field(
        default_factory=lambda: [PRIOR[0] * PRIOR_WEIGHT, (1 - PRIOR[0]) * PRIOR_WEIGHT,
                                 PRIOR[1] * PRIOR_WEIGHT, (1 - PRIOR[1]) * PRIOR_WEIGHT]
    )  # fmt: skip  # first accepted, first rejected, continued accepted, continued rejected

    @property
    def first(self) -> float:
        """Chance that the first proposal is accepted."""
        return self.counts[0] / (self.counts[0] + self.counts[1])

    @property
    def continued(self) -> float:
        """Chance that a proposal after an accepted one is accepted too."""
        return self.counts[2] / (self.counts[2] + self.counts[3])

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

    def idle(self) -> None:
        """A step without verification: drift back towards the prior (probe a request that backed off)."""
        prior = (PRIOR[0], 1 - PRIOR[0], PRIOR[1], 1 - PRIOR[1])
        self.counts = [c + DRIFT * (PRIOR_WEIGHT * p - c) for c, p in zip(self.counts, prior)]


def allocate(
    rates: list[tuple[float, float]], limits: list[int], overhead: float, num_decoding: int, switch: float = 0.0
) -> list[int]:
    """Proposal slots per request, at most ``limits[i]`` for request i of acceptance ``rates[i]``
    (first, continued), in a step of ``num_decoding`` decodes (the speculating requests among
    them) whose forward costs ``overhead + tokens``, and ``switch`` more if it verifies any proposal."""
    plain = num_decoding / (overhead + num_decoding)  # tokens per unit of cost without speculation
    emitted, cost = float(num_decoding), overhead + num_decoding + switch
    ks = [0] * len(rates)
    heap = [(-first, i) for i, ((first, _), limit) in enumerate(zip(rates, limits)) if limit > 0 and first > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        if gain * cost <= emitted:  # the best slot left no longer pays, nor will any other
            break
        emitted, cost, ks[i] = emitted + gain, cost + 1, ks[i] + 1
        if ks[i] < limits[i]:
            heapq.heappush(heap, (-gain * rates[i][1], i))
    return ks if emitted / cost > plain else [0] * len(rates)
