"""``SpeculativeConfig``: how the engine speculates (``PagedConfig(speculative=...)``), and the
per-request options of a ``GenerationConfig`` that ask for it (``prompt_lookup_num_tokens``,
``max_matching_ngram_size``, as in transformers' ``generate``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from transformers import GenerationConfig

METHODS = ("ngram", "draft")
DEFAULT_NGRAM_SIZE = 2  # transformers' default max_matching_ngram_size


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding for every request of an engine that can speculate (see
    ``runtime/speculative/__init__.py`` for which can).

    Attributes:
        num_speculative_tokens: most tokens proposed per request and step (``k``); each verify step
            feeds ``1 + k`` tokens of a request and can emit up to ``k + 1``.
        draft_model: a small model with the target's vocabulary, loaded with
            ``attn_implementation="paged"``, that proposes the tokens (None: n-gram prompt lookup).
        max_matching_ngram_size: prompt lookup matches the last ``n`` tokens, ``n`` from this down to 1
            (transformers' ``max_matching_ngram_size``).
        adaptive: choose each request's ``k`` per step from its running acceptance rate and the
            step's batch size (``adaptive.py``), down to 0; False: always propose ``k``.
        step_overhead_tokens: what one forward costs regardless of its size, in tokens of the
            forward's per-token cost (a step of ``N`` tokens costs ``overhead + N``): the adaptive
            choice speculates while an extra token earns more than it costs. None: the device's
            default (``speculator.DEFAULT_COSTS``).
        switch_cost_tokens: what a step that verifies costs more than a plain decode step of as
            many tokens (another kernel path; on a GPU, no CUDA graph), in the same unit. None: the
            device's default (on the CPU it grows with the batch size).
    """

    num_speculative_tokens: int = 4
    draft_model: Any = None
    max_matching_ngram_size: int = DEFAULT_NGRAM_SIZE
    adaptive: bool = True
    step_overhead_tokens: float | None = None
    switch_cost_tokens: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "max_matching_ngram_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SpeculativeConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"SpeculativeConfig.adaptive must be a bool, got {self.adaptive!r}")
        for name in ("step_overhead_tokens", "switch_cost_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"SpeculativeConfig.{name} must be None or a number >= 0, got {value!r}")
        if self.draft_model is not None and not hasattr(self.draft_model, "config"):
            raise ValueError(
                "SpeculativeConfig.draft_model must be a causal LM (from_pretrained), "
                f"got {type(self.draft_model).__name__}"
            )

    @property
    def method(self) -> str:
        return "draft" if self.draft_model is not None else "ngram"

    @classmethod
    def parse(cls, spec: str, draft_model: Any = None) -> SpeculativeConfig:
        """``"ngram:K"``, ``"ngram:K:N"`` (N: max_matching_ngram_size) or ``"draft:K"`` (with
        ``draft_model``), as the server's ``--speculative`` flag takes them."""
        method, _, rest = spec.partition(":")
        numbers = rest.split(":") if rest else []
        if method not in METHODS or not 1 <= len(numbers) <= (2 if method == "ngram" else 1) or not all(
            n.isdigit() for n in numbers
        ):
            raise ValueError(f"speculative spec must be ngram:K, ngram:K:N or draft:K, got {spec!r}")
        if (method == "draft") != (draft_model is not None):
            raise ValueError(f"speculative spec {spec!r}: draft:K goes with a draft model, ngram without one")
        values = dict(zip(("num_speculative_tokens", "max_matching_ngram_size"), map(int, numbers)))
        return cls(draft_model=draft_model, **values)


@dataclass(frozen=True, slots=True)
class RequestSpeculation:
    """What one request asks for: ``k`` tokens by ``method`` (0: no speculation)."""

    method: str
    k: int
    ngram_size: int = DEFAULT_NGRAM_SIZE


def check_generation_options(config: GenerationConfig) -> None:
    """Refuse, naming them, the speculative options of ``config`` the engine can't honour."""
    k, n = config.prompt_lookup_num_tokens, config.max_matching_ngram_size
    for name, value, least in (("prompt_lookup_num_tokens", k, 0), ("max_matching_ngram_size", n, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if k and (config.num_beams or 1) > 1:
        raise NotImplementedError(
            f"prompt_lookup_num_tokens={k} with num_beams={config.num_beams}: speculative decoding of beam "
            "search is not supported by the paged engine (nor by transformers' generate)"
        )


def request_speculation(config: GenerationConfig, engine: SpeculativeConfig | None) -> RequestSpeculation | None:
    """The request's own ``prompt_lookup_num_tokens`` (0 turns speculation off for it), else the
    engine's ``SpeculativeConfig``; None when neither asks."""
    k = config.prompt_lookup_num_tokens
    if k is not None:
        return RequestSpeculation("ngram", k, config.max_matching_ngram_size or DEFAULT_NGRAM_SIZE) if k else None
    if engine is None:
        return None
    return RequestSpeculation(engine.method, engine.num_speculative_tokens, engine.max_matching_ngram_size)


def with_draft(config: SpeculativeConfig | None, draft_model: Any, k: int | None = None) -> SpeculativeConfig:
    """``config`` (or the defaults) proposing with ``draft_model``, ``k`` tokens a step if given."""
    config = config or SpeculativeConfig()
    return replace(config, draft_model=draft_model, num_speculative_tokens=k or config.num_speculative_tokens)
