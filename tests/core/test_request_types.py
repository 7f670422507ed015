"""``Request`` and ``RequestOutput`` name what they hold: no field typed ``Any`` (core holds the runtime's
objects through the Protocols of ``core/holds.py``)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from hf_paged_attn.core.request import Request, RequestOutput


@pytest.mark.parametrize("cls", [Request, RequestOutput])
def test_no_field_is_typed_any(cls: type) -> None:
    untyped = [f.name for f in fields(cls) if "Any" in str(f.type)]
    assert not untyped, f"{cls.__name__} fields typed Any: {untyped}"
