"""Verification of a speculative step: which of a request's proposals (``ScheduledRequest.draft_ids``)
the target accepts, decided by the sampler (``generation/sampler.py``) on the request's rows.

A request that fed its last token ``t0`` and proposals ``d1..dk`` has ``k + 1`` rows of logits:
row ``i`` is the target's distribution after ``d1..di``. The longest prefix the target agrees with
is accepted, then one more token from the row after it (a correction, or the bonus token when all
``k`` were accepted), so a step emits 1 to ``k + 1`` tokens:

- greedy: ``di`` is accepted while it is row ``i-1``'s argmax: exactly the tokens plain greedy gives;
- sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), which keeps the
  target distribution ``p``: ``di`` drawn from the proposer's ``q`` is accepted with probability
  ``min(1, p(di) / q(di))``; at the first rejection the token is drawn from
  ``normalize(max(p - q, 0))``; after ``k`` acceptances the bonus token from the last row's ``p``.
  Prompt lookup's ``q`` is a point mass on its proposal: accept with ``p(di)``, else draw from ``p``
  without ``di``. ``p`` and ``q`` are the processed distributions (temperature, top-k, top-p, ...).

The updater then records the emitted tokens one by one with their scores and log-probs; the
first that finishes the request (EOS, a stop string or criterion, ``max_new_tokens``) ends it
there; the verified tokens (``t0`` and the accepted proposals before the last emitted token) are
committed to the KV manager, so only they can enter the prefix cache, and the blocks reserved for
the rejected ones are given back (``trim``).
"""

from __future__ import annotations

import torch

from ...core.request import Request
from ..generation.sampling import Sample, draw, token_logprob


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The emitted tokens: ``draft``'s longest prefix equal to ``targets`` (the argmax of each of
    the ``len(draft) + 1`` rows), then the target's token after it."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return targets[: a + 1]


def rejection_sample(
    p: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """The emitted tokens of a sampled request. p: [k + 1, vocab] the target's probabilities after
    each prefix of ``draft`` (k tokens); q: [k, vocab] the proposer's, or None for point masses on
    ``draft`` (prompt lookup). Rows need not be normalised."""
    k = len(draft)
    p = p / p.sum(dim=-1, keepdim=True)
    q = q.to(p.device, p.dtype) if q is not None else None
    rows = torch.arange(k, device=p.device)
    x = torch.tensor(draft, device=p.device)
    p_x = p[rows, x]  # [k]
    q_x = q[rows, x] / q.sum(dim=-1) if q is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    accepted = u * q_x < p_x  # probability min(1, p/q); q_x > 0 for a token drawn from q
    a = int((accepted.long().cumprod(0)).sum())  # leading acceptances
    if a == k:
        return draft + [int(draw(p[k : k + 1], generator))]
    if q is not None:
        residual = (p[a] - q[a] / q[a].sum()).clamp_min(0)
    else:
        residual = p[a].clone()
        residual[draft[a]] = 0
    if not bool(residual.sum() > 0):  # p == q there: a rejection has probability 0, only rounding gets here
        residual = p[a]
    return draft[:a] + [int(draw(residual[None], generator))]


def verify(
    request: Request, draft: list[int], raw: torch.Tensor, argmax: list[int] | None, generator: torch.Generator
) -> list[Sample]:
    """The tokens ``request`` emits after feeding ``draft`` (1 to ``k + 1``), each with what it records.
    raw: [k + 1, vocab] its rows; argmax: those rows' argmax (greedy requests), else None. Consumes the
    draft model's probabilities (``SpecState.q``)."""
    params, state = request.sampling, request.speculation
    scores = None
    if not params.needs_row_work:
        tokens = accept_greedy(draft, argmax)
    else:
        scores = raw
        if params.plan.steps:  # only plans that never read the ids speculate (speculator.py)
            ids = torch.empty(raw.shape[0], 0, dtype=torch.long, device=raw.device)
            scores = params.plan.row_free_tail(ids, raw.clone())
        if params.do_sample:
            q = state.q if state is not None else None
            tokens = rejection_sample(torch.softmax(scores, dim=-1), draft, q, params.generator or generator)
        else:
            tokens = accept_greedy(draft, scores.argmax(dim=-1).tolist())
    if state is not None:
        state.q = None
    return [
        Sample(
            token,
            scores[i].cpu() if params.output_scores else None,
            raw[i].cpu() if params.output_logits else None,
            token_logprob((raw if params.raw_logprobs else scores)[i], token, params.num_logprobs)
            if scores is not None else None,
        )
        for i, token in enumerate(tokens)
    ]
