"""What a request holds for the layers above core, as the little core needs of each.

Core is plain Python: it never imports the runtime's objects (torch tensors, transformers'
processors, llguidance matchers), so it names each by a Protocol of what it does with it (most it
only stores, and copies when a request forks). The runtime's objects satisfy these structurally.
"""

from __future__ import annotations

from typing import Protocol


class Sampling(Protocol):
    """A request's sampling resolved against the model (``runtime.generation.sampling.RequestSampling``)."""

    def for_sequence(self, index: int) -> Sampling:
        """The sampling of forked sibling ``index`` (its own generator when seeded)."""
        ...


class GrammarMatcher(Protocol):
    """A constrained request's grammar state (``runtime.generation.structured.Matcher``)."""

    def accept(self, token: int) -> bool: ...

    def clone(self) -> GrammarMatcher:
        """An independent copy in the same state, for a forked sibling."""
        ...


class Speculation(Protocol):
    """A request's speculative-decoding state (``runtime.speculative.speculator.SpecState``)."""

    draft_computed: int

    def observe(self, num_proposed: int, num_accepted: int) -> None: ...


class ImageInputs(Protocol):
    """A request's images and their encoder output (``runtime.multimodal.MultimodalInputs``)."""

    @property
    def spans(self) -> tuple[tuple[int, int, bytes], ...]:
        """Each image's (first prompt position, number of positions, content digest)."""
        ...


class TensorLike(Protocol):
    """A torch tensor, which core only stores (a position's [vocab] scores) or reads back (a prompt's ids)."""

    def dim(self) -> int: ...

    def tolist(self) -> object: ...
