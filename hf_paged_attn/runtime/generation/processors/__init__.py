"""Logits processors on stacked rows, with transformers' semantics.

transformers runs each processor once per step on the whole ``[batch, len]`` ids of a ``generate``
call. The engine's rows are ragged (each request has its own length, its own left padding) and come
and go every step, so running transformers' processors means one call per row on a ``[1, len]``
tensor built from Python lists. Here instead:

* ``TokenHistory`` keeps every tracked request's ids on the device, one row each, and appends a
  step's tokens to all rows with one ``index_put_``. A step reads its rows as ``Rows``: ``[R, L]``
  ids, ``-1`` past each row's end, and the lengths on the host and the device.
* ``plan_processors`` turns a request's processor list (what ``model._get_logits_processor`` built)
  into a ``ProcessorPlan`` of batched processors, each equal to transformers' own on the row that
  ``generate`` would see (its left padding, prompt and generated tokens). Requests whose plans have
  equal ``key`` run them once on their stacked rows (``run_plans``): a handful of torch ops per
  processor, whatever the number of rows. Settings that may differ per row (lengths, thresholds,
  OpenAI penalties and biases) are not in the key; those the arithmetic depends on are.
* ``GenerateBatch`` rebuilds the exact ``input_ids`` transformers' ``generate`` passes to processors
  and stopping criteria at each step, for a caller's processor that must see the whole batch.

A processor the plan does not know (a caller's own, a subclass) is ``Opaque``: it runs per row on its
``[1, len]`` ids as before, or on a ``GenerateBatch``.

The engine's side, per request whose plan ``needs_rows`` (keys: the ``Request`` objects): ``add``
on the engine thread before its first sample (padding + prompt), ``fork`` a sibling before the
parent's first token is appended, one ``append`` per step for every row sampled (before any of
them is finished and released), ``release`` on finish, abort or error; nothing on preemption.
"""

from .batched import (
    LOGIT_BIAS_LIMIT,
    PENALTY_LIMIT,
    ROW_FREE_PROCESSORS,
    BatchedProcessor,
    LogitBias,
    Opaque,
    PresenceFrequencyPenalty,
    RowFree,
)
from .generate_batch import GenerateBatch
from .history import Rows, TokenHistory
from .plan import ProcessorPlan, openai_options, plan_processors, run_plans, stacks

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "PENALTY_LIMIT",
    "ROW_FREE_PROCESSORS",
    "BatchedProcessor",
    "GenerateBatch",
    "LogitBias",
    "Opaque",
    "PresenceFrequencyPenalty",
    "ProcessorPlan",
    "RowFree",
    "Rows",
    "TokenHistory",
    "openai_options",
    "plan_processors",
    "run_plans",
    "stacks",
]
