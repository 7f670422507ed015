"""``hf-paged-attn serve --kv-cache-dtype / --kv-cache-memory-bytes``: into PagedConfig, a bad value a clear error."""

from __future__ import annotations

import pytest

from hf_paged_attn.serve.cli import main, paged_config, parse_args


def test_the_flags_reach_the_config():
    config = paged_config(parse_args(["model", "--kv-cache-dtype", "fp8_e5m2", "--kv-cache-memory-bytes", "1048576"]))
    assert (config.kv_cache_dtype, config.kv_cache_memory_bytes) == ("fp8_e5m2", 1 << 20)
    assert paged_config(parse_args(["model"])).kv_cache_dtype == "auto"


@pytest.mark.parametrize(
    "flags, named",
    [(["--kv-cache-dtype", "int4"], "'fp8_e4m3'"), (["--kv-cache-memory-bytes", "0"], "kv_cache_memory_bytes")],
)
def test_a_bad_value_exits_with_a_clear_error(flags, named, capsys):
    pytest.importorskip("uvicorn")
    assert main(["model", *flags]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "error" in err and named in err
