"""The libraries transformers users already run, on the engine: TRL's ``GRPOTrainer`` (plain
``generate`` and ``use_transformers_continuous_batching=True``) and lm-evaluation-harness' ``hf``
model (``generate_until`` and ``loglikelihood``, sample for sample identical to sdpa), and its
``local-completions`` model against ``hf-paged-attn serve`` (equal to its ``hf`` model).

Needs the ``[clients]`` extra: ``make test-clients`` (not part of ``make test``: it takes about a
minute to install). Nothing is downloaded: tiny local models, a task and its data written here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_paged_attn.runtime.engine as engine_module
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.testing import save_random_model, tiny_llama_config

pytestmark = pytest.mark.clients
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def engine_steps(monkeypatch):
    """Counts our engine's steps: proves the client's generation ran on the paged engine."""
    calls = []
    step = engine_module.ContinuousBatchingEngine.step
    monkeypatch.setattr(engine_module.ContinuousBatchingEngine, "step", lambda self: calls.append(1) or step(self))
    return calls


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the demo model's tokenizer (it has a chat template)."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    directory = tmp_path_factory.mktemp("grpo_model")
    config = tiny_llama_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    save_random_model(config, directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "generate_batch"])
def test_trl_grpo_trains_two_steps_on_the_engine(chat_model_dir, tmp_path, engine_steps, continuous_batching) -> None:  # noqa: ANN001
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, attn_implementation="paged")
    before = [p.detach().clone() for p in model.parameters()]
    prompts = ["The for statement", "A list is", "Exceptions are", "Python is"]
    train = datasets.Dataset.from_dict({"prompt": prompts * 2})

    def reward(completions: list[str], **kwargs) -> list[float]:  # noqa: ANN003
        return [float(len(c)) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", bf16=False, use_transformers_continuous_batching=continuous_batching,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=train,
                              processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert engine_steps, "the trainer's generation did not run on the paged engine"
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the weights never moved"
    assert model.config._attn_implementation == "paged"


ROWS = [
    ("The for statement", " is"), ("A list is", " a"), ("Exceptions are raised when", " the"),
    ("The import statement", " is"), ("Python is", " a"), ("A tuple is", " a"), ("Functions are", " used"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_tasks(tmp_path_factory) -> str:
    """Two lm-eval tasks on a local jsonl: ``tiny_gen`` (generate_until) and ``tiny_choice`` (loglikelihood)."""
    directory = tmp_path_factory.mktemp("tasks")
    with open(directory / "data.jsonl", "w") as f:
        for i, (question, answer) in enumerate(ROWS):
            f.write(json.dumps({"question": question, "answer": answer, "choices": [" yes", " no", " a"],
                                "label": i % 3}) + "\n")  # fmt: skip
    data = directory / "data.jsonl"
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (directory / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n\\n", "."]\n  max_gen_toks: 24\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    (directory / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n" + common + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n'
    )
    return str(directory)


def test_lm_eval_hf_model_matches_sdpa_sample_for_sample(tiny_tasks, engine_steps) -> None:  # noqa: ANN001
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=tiny_tasks)
    responses = {}
    for attn in ("sdpa", "paged"):
        results = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={DEMO_MODEL},attn_implementation={attn},dtype=float32",
            tasks=["tiny_gen", "tiny_choice"], task_manager=manager, log_samples=True, batch_size=4, device="cpu",
        )  # fmt: skip
        responses[attn] = {task: [s["resps"] for s in samples] for task, samples in results["samples"].items()}
        if attn == "sdpa":
            assert not engine_steps
    assert engine_steps, "lm-eval's generate_until did not run on the paged engine"
    assert len(responses["paged"]["tiny_gen"]) == len(ROWS) and len(responses["paged"]["tiny_choice"]) == len(ROWS)
    assert responses["paged"] == responses["sdpa"]  # texts and log-likelihoods, bit for bit


def test_lm_eval_local_completions_on_our_server_equals_its_hf_model(tiny_tasks) -> None:  # noqa: ANN001
    """lm-eval's ``local-completions`` model against ``hf-paged-attn serve``: loglikelihood (prompt
    log-probabilities through ``echo`` + ``logprobs``) and generate_until equal to lm-eval's ``hf``
    model on the same weights (sdpa): the same texts, log-likelihoods within float32 noise."""
    lm_eval = pytest.importorskip("lm_eval")
    import fastapi  # noqa: F401
    from lm_eval.tasks import TaskManager

    from hf_paged_attn_tools.launch import ServerProcess

    manager = TaskManager(include_path=tiny_tasks)
    tasks = ["tiny_gen", "tiny_choice"]
    # lm-eval's hf model passes max_length = context + max_gen_toks, which the demo model's
    # generation_config.max_new_tokens (64) overrides in transformers; so both get 64 here. And its
    # hf model adds BOS where local-completions does not by default: add_bos_token=True below.
    gen_kwargs = "max_gen_toks=64"

    def responses(results: dict) -> dict:
        return {task: [s["resps"] for s in samples] for task, samples in results["samples"].items()}

    expected = responses(lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={DEMO_MODEL},attn_implementation=sdpa,dtype=float32",
        tasks=tasks, task_manager=manager, log_samples=True, batch_size=4, device="cpu", gen_kwargs=gen_kwargs,
    ))  # fmt: skip
    args = ["--served-model-name", "demo", "--no-compile"]
    with ServerProcess(DEMO_MODEL, args, env={"OMP_NUM_THREADS": "1"}) as server:
        got = responses(lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={server.url}/v1/completions,model=demo,tokenizer_backend=huggingface,"
                       f"tokenizer={DEMO_MODEL},num_concurrent=4,max_retries=1,tokenized_requests=True,add_bos_token=True",
            tasks=tasks, task_manager=manager, log_samples=True, gen_kwargs=gen_kwargs,
        ))  # fmt: skip
    assert got["tiny_gen"] == expected["tiny_gen"]
    assert len(got["tiny_choice"]) == len(ROWS)
    for ours, theirs in zip(got["tiny_choice"], expected["tiny_choice"]):
        assert len(ours) == len(theirs) == 3  # one (log-likelihood, is_greedy) per choice
        for (ll, greedy), (ll_ref, greedy_ref) in zip((r[0] for r in ours), (r[0] for r in theirs)):
            assert ll == pytest.approx(ll_ref, abs=1e-3) and greedy == greedy_ref
