"""Every call of transformers' private API, in one place: the one module to read when a
transformers release changes them. It imports nothing of ours, so every layer may use it.

``generate``'s own helpers build what a request samples with exactly as ``generate`` would: the
merged generation config, its special-token tensors, the logits-processor list, the length limits,
and the vectorised beam-search bookkeeping. Reusing them (rather than re-deriving their rules) is
what keeps our outputs identical to transformers'. Tested against transformers 5.24.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList

# Its beam helpers use only static methods of the class, so they are called with the class as self.
_BEAM = GenerationMixin


# ----------------------------------------------------------------------------- models and configs
def attn_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation the model was loaded with (``attn_implementation=``)."""
    return getattr(model.config, "_attn_implementation", None)


def prepare_generation_config(
    model: torch.nn.Module, generation_config: GenerationConfig | None, **kwargs: Any
) -> tuple[GenerationConfig, dict[str, Any]]:
    """``generate``'s merge of a caller's config (and ``generate`` kwargs) with the model's defaults:
    (the config, the kwargs that are model inputs)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def prepare_special_tokens(
    model: torch.nn.Module, config: GenerationConfig, has_attention_mask: bool, device: torch.device
) -> None:
    """Sets the config's special-token tensors (``eos_token_tensor`` below), as ``generate`` does."""
    model._prepare_special_tokens(config, has_attention_mask, device=device)


def prepare_generated_length(
    model: torch.nn.Module,
    config: GenerationConfig,
    has_default_max_length: bool,
    input_ids: torch.Tensor,
) -> GenerationConfig:
    """``generate``'s resolution of ``max_length`` / ``max_new_tokens`` / ``min_length`` for a batch."""
    return model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=True,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=input_ids.shape[1],
    )


def logits_processors(
    model: torch.nn.Module,
    config: GenerationConfig,
    input_length: int,
    extra: LogitsProcessorList | None,
    device: torch.device,
    model_kwargs: dict[str, Any],
) -> LogitsProcessorList:
    """The processor list ``generate`` builds for ``config`` (the caller's ``extra`` merged in)."""
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_length,
        logits_processor=extra or LogitsProcessorList(),
        device=device,
        model_kwargs=model_kwargs,
    )


def eos_token_tensor(config: GenerationConfig) -> torch.Tensor | None:
    """The EOS ids ``prepare_special_tokens`` resolved, or None."""
    return config._eos_token_tensor


def pad_token_tensor(config: GenerationConfig) -> torch.Tensor | None:
    """The pad id ``prepare_special_tokens`` resolved, or None."""
    return config._pad_token_tensor


# ----------------------------------------------------------------------------- beam search
def running_beams_for_next_iteration(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _BEAM._get_running_beams_for_next_iteration(_BEAM, *args)


def update_finished_beams(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _BEAM._update_finished_beams(_BEAM, *args)


def check_early_stop_heuristic(*args: Any) -> torch.Tensor:
    return _BEAM._check_early_stop_heuristic(*args)


def beam_search_has_unfinished_sequences(*args: Any) -> torch.Tensor:
    return _BEAM._beam_search_has_unfinished_sequences(*args)


def gather_beams(tensor: torch.Tensor, beam_indices: torch.Tensor) -> torch.Tensor:
    return _BEAM._gather_beams(tensor, beam_indices)
