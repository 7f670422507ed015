"""How many tokens each request proposes at a step: never more than pays for itself.

Cost: a forward of ``N`` tokens costs about ``overhead + N`` (in units of its per-token cost): a
fixed part (launches, weights read once, Python) that a big step shares, and a part that grows with
the tokens. ``overhead`` is large where a forward is bound by reading the weights (a GPU, a small
batch) and shrinks as the batch makes it compute-bound; ``StepCost`` fits it to the engine's own
steps.

Gain: a request whose proposed tokens are each accepted with probability ``a`` emits its ``j``-th
proposal with probability ``a**j`` (the first ``j`` all accepted). ``Acceptance`` estimates ``a``
per request, from what its verifications accepted, with a decay (it follows the text) and a drift
back to a prior while the request does not speculate, so a request that backed off to 0 is probed
again now and then.

``allocate`` gives the step's proposal slots, one at a time, to the request whose next proposal is
worth the most, while that worth exceeds what the step's tokens earn on average per unit of cost:
adding a slot of gain ``g`` to a step that emits ``E`` tokens at cost ``T`` pays iff
``(E + g) / (T + 1) > E / T``, i.e. ``g * T > E``. A batch of ``B`` decodes starts at ``E = B``,
``T = overhead + B``: at batch 1 a proposal pays when ``a**j > 1 / (overhead + 1)``, at a batch far
above ``overhead`` only when ``a**j`` is near 1, so a big batch stops speculating by itself.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PRIOR_RATE = 0.6  # what a request's first proposals are assumed to earn
PRIOR_WEIGHT = 2.0  # in verifications
DECAY = 0.8  # weight of the past at each verification (about the last 5 count)
DRIFT = 0.05  # share of the way back to the prior per step without a verification


@dataclass(slots=True)
class Acceptance:
    """Decayed counts of accepted and rejected proposals of one request (the maximum-likelihood
    rate of a run that stops at its first rejection: accepted / (accepted + rejections))."""

    accepted: float = PRIOR_RATE * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_RATE) * PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + float(num_accepted < num_proposed)

    def idle(self) -> None:
        """A step without verification: drift back towards the prior (probe a request that backed off)."""
        self.accepted += DRIFT * (PRIOR_RATE * PRIOR_WEIGHT - self.accepted)
        self.rejected += DRIFT * ((1 - PRIOR_RATE) * PRIOR_WEIGHT - self.rejected)


def allocate(rates: list[float], limits: list[int], overhead: float, num_decoding: int) -> list[int]:
    """Proposal slots per request, at most ``limits[i]`` for request i of acceptance ``rates[i]``,
    in a step of ``num_decoding`` decodes (the speculating requests among them) whose forward costs
    ``overhead + tokens``."""
    emitted, cost = float(num_decoding), overhead + num_decoding
    ks = [0] * len(rates)
    heap = [(-rate, i) for i, (rate, limit) in enumerate(zip(rates, limits)) if limit > 0 and rate > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        if gain * cost <= emitted:  # the best slot left no longer pays, nor will any other
            break
        emitted, cost, ks[i] = emitted + gain, cost + 1, ks[i] + 1
        if ks[i] < limits[i]:
            heapq.heappush(heap, (-gain * rates[i], i))
    return ks


class StepCost:
    """A least-squares fit of ``seconds = fixed + per_token * tokens`` over the engine's recent
    decode and verify steps (exponentially forgotten), blended with a prior ``overhead``: the fit
    only counts once the steps' sizes have varied enough to tell the two parts apart."""

    FORGET = 0.98  # weight of the past per step: about the last 50 steps count
    MIN_SPREAD = 1.0  # tokens: the standard deviation of step sizes the fit needs

    def __init__(self, prior_overhead: float, fixed: float | None = None) -> None:
        self.prior = prior_overhead
        self.fixed = fixed  # a user's overhead: never fitted
        self._sums = [0.0] * 5  # weight, sum x, sum x^2, sum y, sum x*y

    def observe(self, num_tokens: int, seconds: float) -> None:
        w, sx, sxx, sy, sxy = (self.FORGET * s for s in self._sums)
        self._sums = [w + 1, sx + num_tokens, sxx + num_tokens * num_tokens, sy + seconds, sxy + num_tokens * seconds]

    @property
    def overhead(self) -> float:
        if self.fixed is not None:
            return self.fixed
        w, sx, sxx, sy, sxy = self._sums
        if w < 8:
            return self.prior
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x < self.MIN_SPREAD**2:
            return self.prior
        slope = (sxy / w - mean_x * mean_y) / var_x
        intercept = mean_y - slope * mean_x
        if slope <= 0 or intercept <= 0:  # noise (a shared machine): keep the prior
            return self.prior
        return intercept / slope
