"""``hf-paged-attn serve --no-compile``: eager forwards, ``PagedConfig(compile=False)``."""

from __future__ import annotations

from hf_paged_attn.serve.cli import paged_config, parse_args


def test_no_compile_reaches_the_config():
    assert paged_config(parse_args(["model", "--no-compile"])).compile is False
    assert paged_config(parse_args(["model"])).compile is None  # where it wins (PagedConfig's default)
