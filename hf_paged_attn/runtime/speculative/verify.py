"""Verification of a speculative step: the part of ``Updater.apply`` for the requests that fed
proposed tokens (``Request.draft_ids``), called from it at one place.

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

Then, in order: the emitted tokens are recorded one by one with their scores and log-probs; the
first that finishes the request (EOS, a stop string or criterion, ``max_new_tokens``) ends it
there; the verified tokens (``t0`` and the accepted proposals before the last emitted token) are
committed to the KV manager, so only they can enter the prefix cache, and the blocks reserved for
the rejected ones are given back (``trim``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...core.request import Request, RequestOutput
from ...core.scheduler import ScheduledRequest, SchedulerOutput
from ..generation.sampling import draw, should_stop, token_logprob

if TYPE_CHECKING:
    from ..update import Updater


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


def verify_step(
    updater: Updater, plan: SchedulerOutput, logits: torch.Tensor
) -> tuple[SchedulerOutput, torch.Tensor, list[RequestOutput]]:
    """Verify the step's speculating requests; returns the plan of the others with their logits
    rows (for ``Updater.apply`` to go on as for any step) and the speculating requests' outputs.
    logits: [num_sampled, vocab] float32, every speculating request's ``1 + k`` rows in place."""
    rest: list[ScheduledRequest] = []
    rest_rows: list[int] = []
    runs: list[tuple[Request, int]] = []  # (request, its first row)
    row = 0
    for s in plan.scheduled:
        request = s.request
        if request.draft_ids:
            assert s.num_new_tokens == 1 + len(request.draft_ids) and not request.children
            runs.append((request, row))
            row += 1 + len(request.draft_ids)
        else:
            rest.append(s)
            if request.num_computed_tokens + s.num_new_tokens == request.num_tokens:
                rest_rows.append(row)
                row += 1
    assert row == logits.shape[0], f"{row} rows expected, the step has {logits.shape[0]}"
    if not runs:
        return plan, logits, []
    argmax = logits.argmax(dim=-1).tolist() if any(not r.sampling.needs_row_work for r, _ in runs) else None
    outputs = []
    for request, first in runs:
        try:
            outputs += _verify(updater, request, logits[first : first + 1 + len(request.draft_ids)], argmax, first)
        except Exception as exc:  # e.g. a processor that raises: this request fails alone
            request.draft_ids = []
            outputs += updater.finish(request, "error", exc)
    rest_plan = SchedulerOutput(rest, plan.block_copies, plan.preempted)
    index = torch.tensor(rest_rows, dtype=torch.long, device=logits.device)
    return rest_plan, logits.index_select(0, index), outputs


def _verify(
    updater: Updater, request: Request, raw: torch.Tensor, argmax: list[int] | None, first: int
) -> list[RequestOutput]:
    """One request's run: accept, record, commit, trim. raw: [k + 1, vocab] its rows."""
    params, draft = request.sampling, request.draft_ids
    state = request.speculation
    scores = None
    if not params.needs_row_work:
        tokens = accept_greedy(draft, argmax[first : first + len(draft) + 1])
    else:
        scores = raw
        if params.plan.steps:  # only plans that never read the ids speculate (speculator.py)
            ids = torch.empty(raw.shape[0], 0, dtype=torch.long, device=raw.device)
            scores = params.plan.row_free_tail(ids, raw.clone())
        if params.do_sample:
            generator = params.generator or updater.generator
            q = state.q if state is not None else None
            tokens = rejection_sample(torch.softmax(scores, dim=-1), draft, q, generator)
        else:
            tokens = accept_greedy(draft, scores.argmax(dim=-1).tolist())
    num_accepted = len(tokens) - 1
    if state is not None:
        state.observe(len(draft), num_accepted)
        state.q = None
    request.draft_ids = []
    counters = updater.counters
    counters.num_draft_tokens += len(draft)
    for i, token in enumerate(tokens):
        request.append(
            token,
            scores[i].cpu() if params.output_scores else None,
            raw[i].cpu() if params.output_logits else None,
            token_logprob((raw if params.raw_logprobs else scores)[i], token, params.num_logprobs)
            if scores is not None else None,
        )
        counters.num_generated_tokens += 1
        counters.num_accepted_tokens += int(i < num_accepted)
        reason = _finish_reason(request, token, raw[i : i + 1])
        if reason is not None:
            updater.kv.commit(request, i + 1)  # t0 and the proposals before this token: all verified
            return updater.finish(request, *reason) if isinstance(reason, tuple) else updater.finish(request, reason)
    updater.kv.commit(request, len(tokens))
    updater.kv.trim(request)
    return [request.take_output()]


def _finish_reason(request: Request, token: int, logits: torch.Tensor) -> str | tuple[str, Exception] | None:
    """Why ``request`` ends at its newest token ``token``, as ``Updater._record`` decides it."""
    try:
        stop = should_stop(request, logits)
    except Exception as exc:  # a caller's stopping criterion raised: that request fails alone
        return ("error", exc)
    if token in request.sampling.eos_token_ids:
        return "eos"
    if stop:
        return "stop"
    if len(request.output_ids) >= request.max_new_tokens:
        return "length"
    return None
