"""Structured outputs under a LoRA adapter: a constrained request under adapter "a" gives one of its choices,
each token the argmax of PEFT's logits under "a" (on sdpa) over what the grammar allows; a free request under
"a" in the same batch keeps PEFT's greedy tokens. On the bundled demo model (a real tokenizer), with a random
adapter; on the torch loop and on the Triton path (forced on the CPU, the kernels interpreted)."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("llguidance")

import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.demo import DEMO_MODEL  # noqa: E402
from hf_paged_attn.runtime.model import lora_kernels  # noqa: E402
from hf_paged_attn_tools.testing import compare_greedy, reference_greedy, save_random_lora  # noqa: E402

# choices that share first words, so the grammar leaves the model real decisions after them
CHOICES = ["red apple", "red pear", "green apple", "green tea", "blue sky"]
NEW = 8


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(tokenizer, PEFT on sdpa, PEFT on paged), both holding adapter "a" on the demo model."""
    path = save_random_lora(str(DEMO_MODEL), tmp_path_factory.mktemp("demo_lora"), seed=5,
                            target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)

    def load(attn: str) -> PeftModel:
        base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation=attn, dtype=torch.float32)
        return PeftModel.from_pretrained(base, path, adapter_name="a").eval()

    return tokenizer, load("sdpa"), load("paged")


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens llguidance allows next, unpacked from its bitmask (bit j of word i: token 32i+j)."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab].bool()


def check_masked_argmax(ref: PeftModel, tokenizer, prompt: list[int], output: list[int]) -> int:
    """Each token of ``output`` is the argmax of ``ref``'s logits over the tokens the choice grammar allows
    after the tokens before it (up to a 1e-4 near-tie); returns how many positions left more than one."""
    vocab = ref.config.vocab_size
    grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in CHOICES))
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 :].float()  # [new + 1, vocab]
    decisions = 0
    for i, token in enumerate(output):
        allowed = allowed_tokens(matcher, vocab)
        decisions += int(allowed.sum() > 1)
        masked = logits[i].masked_fill(~allowed, -torch.inf)
        assert allowed[token], f"token {i} ({token}) is not allowed by the grammar"
        if token != int(masked.argmax()):
            assert float(masked.max() - masked[token]) <= 1e-4, (i, token, int(masked.argmax()))
        assert matcher.consume_token(token), matcher.get_error()
    return decisions


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_structured_outputs_under_an_adapter(parts, path, monkeypatch):
    tokenizer, ref, paged = parts
    if path == "triton":
        monkeypatch.setattr(lora_kernels, "use_triton", lambda device: True)
    prompt = tokenizer("Pick a fruit or a colour:")["input_ids"]
    free_prompt = tokenizer("The for statement")["input_ids"]
    with ContinuousBatchingEngine(paged, PagedConfig()) as engine:
        constrained, free = engine.add_all([
            dict(input_ids=prompt, max_new_tokens=NEW, adapter_name="a", structured={"choice": CHOICES},
                 tokenizer=tokenizer),
            dict(input_ids=free_prompt, max_new_tokens=NEW, adapter_name="a"),
        ])  # fmt: skip
        constrained, free = engine.collect([constrained, free])
    assert tokenizer.decode(constrained.output_ids, skip_special_tokens=True) in CHOICES
    assert constrained.finish_reason in ("stop", "eos"), constrained.finish_reason
    assert check_masked_argmax(ref, tokenizer, prompt, constrained.output_ids) >= 1
    want = reference_greedy(ref, free_prompt, NEW)  # PEFT on sdpa, adapter "a" active
    assert not compare_greedy(ref, [free_prompt], [want], [free.output_ids])
    with ref.disable_adapter():
        assert reference_greedy(ref, free_prompt, NEW) != want  # the adapter is not a no-op here
