"""The batch calls of the engine: many prompts in, their final outputs in order. One collect loop
serves ``engine.generate`` and ``model.generate``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from ..core.request import RequestOutput

if TYPE_CHECKING:
    from ..core.intake import Intake
    from .config import PagedConfig


class BatchAPI:
    """Mixed into ``ContinuousBatchingEngine``: built on its ``add_request`` and ``stream``."""

    config: PagedConfig
    intake: Intake
    add_request: Callable[..., str]
    stream: Callable[[], Iterator[RequestOutput]]

    def generate(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        max_new_tokens: int | Sequence[int] | None = None,
        generation_config: GenerationConfig | None = None,
        progress_bar: bool | None = None,
    ) -> list[RequestOutput]:
        """Ragged prompts in, final outputs in input order (``num_return_sequences`` outputs per prompt)."""
        if isinstance(max_new_tokens, Sequence):
            if len(max_new_tokens) != len(prompts):
                raise ValueError(f"got {len(max_new_tokens)} max_new_tokens for {len(prompts)} prompts")
            limits = list(max_new_tokens)
        else:
            limits = [max_new_tokens] * len(prompts)
        ids = self.add_all([dict(input_ids=p, max_new_tokens=n, generation_config=generation_config)
                            for p, n in zip(prompts, limits)], final_only=True)  # fmt: skip
        return self.collect(ids, progress_bar)

    def add_all(self, requests: list[dict], final_only: bool = False) -> list[str]:
        """``add_request(**kwargs)`` for each; all or nothing: if one is refused, none stays queued.
        ``final_only``: the caller collects only finished outputs (``Request.final_only``): the requests and
        their forked siblings make no output object while they run (~2.5 us a request and step)."""
        ids: list[str] = []
        try:
            for kwargs in requests:
                ids.append(self.add_request(**kwargs))
        except Exception:
            self.intake.withdraw(ids)
            raise
        if final_only:
            live = self.intake.live
            for member in (m for rid in ids for m in [live[rid], *live[rid].children]):
                member.final_only = True
        return ids

    def collect(
        self,
        ids: list[str],
        progress_bar: bool | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Step until every request has finished; the final outputs of ``ids``, each followed by its
        forked siblings, in the order of ``ids``. ``on_output`` sees every output as it comes."""
        live = self.intake.live
        families = {rid: [r.request_id for r in [live[rid], *live[rid].children]] for rid in ids}
        finals: dict[str, RequestOutput] = {}
        with self._progress(sum(map(len, families.values())), progress_bar) as bar:
            for output in self.stream():
                if on_output is not None:
                    on_output(output)
                if output.finished and output.request_id in families.get(output.parent_id or output.request_id, ()):
                    finals[output.request_id] = output
                    bar.update(1)
        return [finals[member] for rid in ids for member in families[rid]]

    def _progress(self, total: int, flag: bool | None):
        from tqdm.auto import tqdm

        show = flag if flag is not None else self.config.progress_bar
        if show is None:
            show = total > 8 and sys.stderr.isatty()
        return tqdm(total=total, disable=not show, desc="paged generate", unit="req")

