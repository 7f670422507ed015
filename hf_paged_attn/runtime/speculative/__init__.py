"""Speculative decoding on paged blocks, inside continuous batching: cheap proposals for the next
few tokens of each decoding request, verified by the target in one forward whose rows for a
request are its last token and its ``k`` proposals (the varlen path's multi-query rows).

| module | what |
| --- | --- |
| ``config.py`` | ``SpeculativeConfig`` (``PagedConfig.speculative``) and the per-request options |
| ``ngram.py`` | prompt lookup: transformers' candidate choice from an incremental n-gram index |
| ``draft.py`` | a draft model on its own paged cache, addressed by the target's block ids |
| ``adaptive.py`` | each request's ``k`` per step from its acceptance rate and the step's cost |
| ``speculator.py`` | the engine's two calls around the scheduler: ``plan`` (before), ``propose`` (after) |
| ``verify.py`` | acceptance (greedy, rejection sampling), run by the sampler |

A step: ``plan`` -> ``Scheduler.schedule`` (reserves ``1 + lookahead`` tokens of a speculating
decode) -> ``propose`` (the final plan: ``ScheduledRequest.draft_ids``) -> ``build_step`` (proposals
fed, ``1 + k`` rows sampled) -> execute -> the sampler's ``verify`` -> ``Updater.update`` (record,
commit, trim). Proposals live in the plan, never in ``output_ids``, until accepted; only verified
tokens are committed, so no block holding a rejected token is ever registered in the prefix cache,
and the blocks reserved for rejected tokens go back at once (``KVBlockManager.trim``).
"""

from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
