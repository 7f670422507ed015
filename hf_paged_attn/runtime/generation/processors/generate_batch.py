"""``GenerateBatch``: the exact ``input_ids`` transformers' ``generate`` passes to processors and
stopping criteria at each step, for a caller's processor that must see the whole batch."""


from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList


# ------------------------------------------------------------------------------------------ generate's batch
class GenerateBatch:
    """The ``input_ids`` transformers' ``generate`` hands its processors and stopping criteria at
    each step, for the rows of one call, so a caller's processor or criterion runs once per step
    on the whole batch, as there.

    Row ``b`` is row ``b`` of ``generate``'s batch (after ``num_return_sequences``' expansion:
    prompt ``i``'s sequences are rows ``i * n`` to ``i * n + n - 1``): its left padding and prompt,
    then one token per step. In transformers' ``_sample`` a finished row goes on receiving
    ``pad_token_id`` (``next_tokens * unfinished + pad * (1 - unfinished)``) when the stopping
    criteria include EOS, i.e. when an ``eos_token_id`` is set; it keeps its EOS. Without EOS a row
    stopped early (by a caller's criterion) keeps being *sampled* there, which the engine cannot
    reproduce: ``append`` then raises. (transformers defers the stop check by one step only on
    MPS; the extra step is undone and not reproduced here.)

    ``pad_token_id``: the prepared config's ``_pad_token_tensor`` when its ``_eos_token_tensor`` is
    set, else None. The caller keeps the batch in step: ``append`` takes a token for every
    unfinished row at once.
    """

    def __init__(self, input_ids: torch.Tensor, max_new_tokens: int, pad_token_id: int | None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, len], got shape {tuple(input_ids.shape)}")
        batch, width = input_ids.shape
        self.buffer = torch.empty(batch, width + max_new_tokens, dtype=torch.long, device=input_ids.device)
        self.buffer[:, :width] = input_ids
        self.length = width
        self.pad_token_id = pad_token_id
        self.unfinished = torch.ones(batch, dtype=torch.bool)  # host

    @property
    def batch_size(self) -> int:
        return self.buffer.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """[batch, padded prompt + steps so far] int64: what ``generate`` passes at this step (a view)."""
        return self.buffer[:, : self.length]

    def finish(self, row: int) -> None:
        """Row ``row`` finished (its last token is in): from the next step on it is padded."""
        self.unfinished[row] = False

    def append(self, rows: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> None:
        """This step's tokens: ``tokens[i]`` is row ``rows[i]``'s; ``rows`` must be exactly the unfinished rows."""
        unfinished = torch.nonzero(self.unfinished).flatten().tolist()
        if sorted(rows) != unfinished:
            raise ValueError(f"a step needs a token from every unfinished row {unfinished}, got rows {sorted(rows)}")
        if self.length == self.buffer.shape[1]:
            raise ValueError(f"the batch already holds its {self.buffer.shape[1]} columns")
        if len(rows) < self.batch_size and self.pad_token_id is None:
            raise ValueError(
                "a row finished before the others without EOS in the stopping criteria: transformers' generate "
                "would keep sampling it, the engine does not"
            )
        column = self.buffer[:, self.length]
        column.fill_(self.pad_token_id if self.pad_token_id is not None else 0)
        index = torch.tensor(list(rows), dtype=torch.long, device=column.device)
        column[index] = torch.as_tensor(tokens, dtype=torch.long).to(column.device).view(-1)
        self.length += 1

    def batch_scores(self, rows: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        """[batch, vocab]: ``scores[i]`` in row ``rows[i]``, zeros in the others (transformers would
        pass a finished row's logits there: the engine no longer computes them)."""
        full = scores.new_zeros(self.batch_size, scores.shape[-1])
        full[torch.tensor(list(rows), dtype=torch.long, device=scores.device)] = scores
        return full

    def process(self, processors: LogitsProcessorList, rows: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        """``processors`` once on the whole batch, as ``generate`` calls them; ``scores`` [len(rows),
        vocab] are rows ``rows``'s, and so is what comes back."""
        index = torch.tensor(list(rows), dtype=torch.long, device=scores.device)
        return processors(self.input_ids, self.batch_scores(rows, scores))[index]

    def should_stop(self, criteria: StoppingCriteriaList, scores: object = None) -> torch.Tensor:
        """``criteria`` on the batch after this step's ``append``, as ``generate`` calls them
        (``scores``: generate passes its tuple of recorded scores, None unless ``output_scores``).
        Returns [batch] bool on the host."""
        return criteria(self.input_ids, scores).cpu()
