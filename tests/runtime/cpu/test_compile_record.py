"""``PagedConfig(compile=None)`` compiles at start-up a model this machine has compiled before, whose graphs
inductor's disk cache holds (``runtime/cpu/compile_record.py``), and in the background any other; an explicit
``compile=True`` stays in the background."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import PagedConfig
from hf_paged_attn.runtime import config as paged_config
from hf_paged_attn.runtime.cpu import compile_record
from hf_paged_attn_tools.testing import load_pair


@pytest.fixture
def records(tmp_path, monkeypatch):
    """Records under a directory of the test's own; compile=None means compile, as outside the test suite."""
    monkeypatch.setenv("HF_PAGED_ATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(paged_config, "COMPILE_BY_DEFAULT", True)
    monkeypatch.setattr(paged_config, "cpp_compiler", lambda: "c++")
    return tmp_path


def test_compile_none_waits_at_start_up_only_for_a_model_compiled_before(records, llama_dir) -> None:
    _, paged = load_pair(llama_dir)
    assert not compile_record.recorded(paged)
    assert PagedConfig().for_model(paged).compile is True  # in the background: a cold compile takes minutes
    compile_record.record(paged, torch.get_num_threads())
    assert compile_record.recorded(paged)
    assert PagedConfig().for_model(paged).compile == "startup"
    assert PagedConfig(compile=True).for_model(paged).compile is True  # the caller's choice stands
    assert PagedConfig(compile=False).for_model(paged).compile is False
    resolved = PagedConfig().for_model(paged)
    assert resolved.for_model(paged) == resolved  # resolving twice (generate, then its engine) changes nothing


def test_a_record_is_of_one_model_shape_dtype_thread_count_and_inductor_cache(records, llama_dir, monkeypatch) -> None:
    _, paged = load_pair(llama_dir)
    compile_record.record(paged, 2)
    assert compile_record.recorded(paged, 2) and not compile_record.recorded(paged, 1)
    assert not compile_record.recorded(paged.to(torch.bfloat16), 2)
    paged.to(torch.float32)
    eps, paged.config.rms_norm_eps = paged.config.rms_norm_eps, 0.5  # another config: other graphs
    assert not compile_record.recorded(paged, 2)
    paged.config.rms_norm_eps = eps
    assert compile_record.recorded(paged, 2)
    paged.config._name_or_path = "/elsewhere/a-copy"  # the same model loaded from another directory
    assert compile_record.recorded(paged, 2)
    monkeypatch.setattr(compile_record, "inductor_cache_dir", lambda: str(records / "gone"))
    assert not compile_record.recorded(paged, 2)  # inductor's cache was removed: the graphs with it


def test_a_compile_that_succeeds_is_recorded(records, llama_dir) -> None:
    from hf_paged_attn import ContinuousBatchingEngine

    _, paged = load_pair(llama_dir)
    with ContinuousBatchingEngine(paged, PagedConfig(compile="startup", adaptive_threads=False)) as engine:
        executor = getattr(engine.executor, "inner", engine.executor)
        assert executor.graph_ready
    assert compile_record.recorded(paged)
