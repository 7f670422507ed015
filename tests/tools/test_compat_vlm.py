"""The image-text-to-text matrix (``hf_paged_attn_tools.compat_vlm``): every architecture of transformers'
mapping is listed in docs/compatibility_vlm.md; the refusals (cheap: configs only) and two families' parity
run here, the whole matrix under the slow marker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_paged_attn.runtime.multimodal import CHECKED_FAMILIES
from hf_paged_attn_tools.compat_vlm import candidates, check_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility_vlm.md"


def recorded() -> dict[str, tuple[str, str]]:
    rows = re.findall(r"^\| `([^`]+)` \| `[^`]+` \| (\w+) \| (.*) \|$", DOC.read_text(), flags=re.M)
    return {model_type: (result, note) for model_type, result, note in rows}


def test_every_architecture_is_listed():
    assert set(recorded()) == set(candidates())
    assert {t for t, (result, _) in recorded().items() if result == "pass"} == set(CHECKED_FAMILIES)


def test_refusals_are_by_name_and_match_the_docs():
    docs = recorded()
    for model_type in sorted(set(candidates()) - set(CHECKED_FAMILIES)):
        result = check_model(model_type)
        assert (result.result, result.note) == docs[model_type], model_type


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_parity(model_type):
    result = check_model(model_type)
    assert result.result == "pass", result.note


@pytest.mark.slow
def test_full_matrix_matches_docs():
    docs = recorded()
    measured = {t: check_model(t) for t in candidates()}
    changed = {t: (docs[t], r.result, r.note) for t, r in measured.items() if (r.result, r.note) != docs[t]}
    assert not changed, changed
