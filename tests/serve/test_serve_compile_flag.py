"""``hf-paged-attn serve``'s compile: before the server listens (``PagedConfig(compile="startup")``) where
``compile=None`` would compile; ``--no-compile``: eager forwards, ``PagedConfig(compile=False)``."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn.serve.cli import compiled_at_startup, load, paged_config, parse_args
from hf_paged_attn_tools.testing import ragged_prompts, save_random_model, tiny_llama_config

CPU = torch.device("cpu")


def test_no_compile_reaches_the_config():
    assert paged_config(parse_args(["model", "--no-compile"])).compile is False
    assert paged_config(parse_args(["model"])).compile is None  # where it wins (PagedConfig's default)


@pytest.fixture
def compiles_by_default(monkeypatch):
    monkeypatch.setattr("hf_paged_attn.runtime.config.COMPILE_BY_DEFAULT", True)
    monkeypatch.setattr("hf_paged_attn.runtime.config.cpp_compiler", lambda: "/usr/bin/c++")


def test_the_server_compiles_at_startup_where_compile_none_would(compiles_by_default, monkeypatch):
    assert compiled_at_startup(paged_config(parse_args(["model"])), CPU).compile == "startup"
    assert compiled_at_startup(paged_config(parse_args(["model", "--no-compile"])), CPU).compile is False
    assert compiled_at_startup(paged_config(parse_args(["model"])), torch.device("meta")).compile is None
    monkeypatch.setattr("hf_paged_attn.runtime.config.COMPILE_BY_DEFAULT", False)  # as the test suite's
    assert compiled_at_startup(paged_config(parse_args(["model"])), CPU).compile is None


def test_load_returns_an_engine_whose_first_request_runs_compiled(compiles_by_default, monkeypatch, tmp_path):
    """``load`` runs before the socket is bound, so the server listens (and /health answers) only once the
    compile is done."""
    directory = save_random_model(tiny_llama_config(), tmp_path / "model")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: "tokenizer")
    engine, tokenizer = load(parse_args([directory, "--device", "cpu", "--num-blocks", "64"]))
    with engine:
        executor = getattr(engine.executor, "inner", engine.executor)
        assert engine.config.compile == "startup" and executor.graph_ready
        engine.generate(ragged_prompts(2, 3, 20, seed=1), max_new_tokens=4)
        assert executor.num_compiled_steps == engine.stats.num_steps > 0
