"""``SamplingParams``: what one request generates and records, as ``engine.add_request`` takes it.

As in vLLM, what to sample is one object, and what identifies or schedules the request (its id,
priority, LoRA adapter, images, ``generate``'s batch context) stays an ``add_request`` argument. The
options are checked here, where they are made; what depends on the model (the generation config's
merge with the model's, EOS ids, processors) is resolved per request by ``sampling.make_sampling_params``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..config import LOGPROBS_MODES


@dataclass(slots=True)
class SamplingParams:
    """How a request samples and what it records.

    ``max_new_tokens``: None takes the generation config's (else what its ``max_length`` leaves).
    ``generation_config``: greedy, sampling and beam search settings, merged over the engine's as
    ``generate`` merges them (None: the engine's). ``logits_processor`` / ``stopping_criteria``: the
    caller's own, added to what the config builds. ``logprobs=k``: each new token's log-probability and
    its ``k`` best alternatives, from the distribution ``logprobs_mode`` names (``"processed_logprobs"``
    or ``"raw_logprobs"``; None: ``PagedConfig.logprobs_mode``). ``prompt_logprobs=k``: score every prompt
    token too (the request is then computed whole, never served from the prefix cache). ``seed``: the
    request's own generator. ``ignore_eos``: EOS does not end the request (vLLM's; processors still see
    it). ``structured``: a ``structured.StructuredSpec`` or a dict of its fields (``{"json": schema}``,
    ``{"regex": ...}``, ...) the output must match (the ``[structured]`` extra). ``tokenizer``: what
    ``stop_strings`` and ``structured`` are read with.
    """

    max_new_tokens: int | None = None
    generation_config: GenerationConfig | None = None
    logits_processor: LogitsProcessorList | None = None
    stopping_criteria: StoppingCriteriaList | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str | None = None
    seed: int | None = None
    ignore_eos: bool = False
    structured: object | None = None
    tokenizer: object | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and not _is_int(self.max_new_tokens, minimum=1):
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.generation_config is not None and not isinstance(self.generation_config, GenerationConfig):
            raise ValueError(f"generation_config must be None or a GenerationConfig, got {self.generation_config!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, minimum=0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured is not None and self.ignore_eos:  # the grammar's end is its EOS
            raise ValueError("ignore_eos cannot be combined with structured outputs: a complete output ends at EOS")

    @classmethod
    def split(cls, options: dict[str, object]) -> tuple[SamplingParams, dict[str, object]]:
        """``add_request``'s keyword form: the options named like this class's fields as one object, and
        the others (a vision-language model's image inputs) apart."""
        names = FIELDS & options.keys()
        params = cls(**{name: options[name] for name in names})
        return params, {name: value for name, value in options.items() if name not in names}


FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _is_int(value: object, minimum: int | None = None) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return ok and (minimum is None or value >= minimum)
