"""Speculative decoding, structured outputs and prompt log-probabilities, on the device's default path
(on CUDA: CUDA graphs for decode steps, the backend ``kernel="auto"`` picks), none of it run on a GPU before:

- ``speculative/fp32``: prompt lookup and a draft model (the model's own twin: every proposal is
  accepted, so verify steps with ``1 + k`` rows per request run every step) give sdpa's plain
  greedy tokens, up to a near-tie;
- ``prompt-logprobs/fp32``: ``add_request(prompt_logprobs=k)`` equals the log-softmax of sdpa's
  forward over the whole prompt, chunked prefill included;
- ``structured/fp32``: constrained requests (a JSON schema and a regex, on the bundled model and its
  tokenizer) beside free ones: every constrained output matches, the free ones are sdpa's greedy.
"""

from __future__ import annotations

import importlib.util
import json
import re

import torch

from ..base import Check, Context, Fail, Skip
from ..helpers import NEW_TOKENS, TIE_TOLERANCE, compare_up_to_tie, load_model, sdpa_greedy


def _prompts(vocab_size: int, tiny: bool) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds proposals) and random ones."""
    gen = torch.Generator().manual_seed(11)
    loops = [(torch.randint(2, vocab_size, (n,), generator=gen).tolist() * 4)[: 4 * n] for n in (3, 5)]
    plain = [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in ((7, 19) if tiny else (7, 19, 40))]
    return loops + plain


def speculative(ctx: Context) -> str:
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig, SpeculativeConfig

    directory = ctx.tiny_llama()
    new = 8 if ctx.tiny else NEW_TOKENS
    ref = load_model(directory, "sdpa", ctx.device)
    paged = load_model(directory, "paged", ctx.device)
    twin = load_model(directory, "paged", ctx.device)
    prompts = _prompts(ref.config.vocab_size, ctx.tiny)
    wants = [sdpa_greedy(ref, p, new) for p in prompts]
    tol = TIE_TOLERANCE[torch.float32]
    parts = []
    for label, draft in (("prompt lookup", None), ("twin draft", twin)):
        speculative = SpeculativeConfig(num_speculative_tokens=3, draft_model=draft, adaptive=False)
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=16, num_blocks=128, speculative=speculative))
        outs = engine.generate(prompts, max_new_tokens=new)
        compared = sum(compare_up_to_tie(f"{label} prompt {i}", o.output_ids, want, gaps, tol)
                       for i, (o, (want, gaps)) in enumerate(zip(outs, wants, strict=True)))  # fmt: skip
        stats = engine.stats
        if not stats.num_draft_tokens:
            raise Fail(f"{label}: nothing was proposed")
        if draft is not None and stats.num_accepted_tokens < stats.num_draft_tokens // 2:
            raise Fail(f"twin draft: {stats.num_accepted_tokens}/{stats.num_draft_tokens} accepted (it agrees)")
        parts.append(f"{label} {compared} steps, {stats.num_accepted_tokens}/{stats.num_draft_tokens} accepted")
    return f"{len(prompts)} prompts equal sdpa: " + "; ".join(parts)


def prompt_logprobs(ctx: Context) -> str:
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

    directory = ctx.tiny_llama()
    ref = load_model(directory, "sdpa", ctx.device)
    paged = load_model(directory, "paged", ctx.device)
    prompts = _prompts(ref.config.vocab_size, ctx.tiny)
    worst = 0.0
    for max_batch_tokens in (512, 9):  # whole prompts, then chunked prefill
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=16, num_blocks=128,
                                                             max_batch_tokens=max_batch_tokens))  # fmt: skip
        ids = [engine.add_request(p, max_new_tokens=2, prompt_logprobs=2) for p in prompts]
        finals = {o.request_id: o for o in engine.stream() if o.finished}
        for rid, prompt in zip(ids, prompts, strict=True):
            scored = finals[rid].prompt_logprobs
            if scored is None or len(scored) != len(prompt) or scored[0] is not None:
                raise Fail(f"prompt of {len(prompt)} tokens: {None if scored is None else len(scored)} entries")
            with torch.no_grad():
                logits = ref(torch.tensor([prompt], device=ctx.device)).logits[0, :-1].float()
            want = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
            got = torch.tensor([e.logprob for e in scored[1:]])
            worst = max(worst, float((got - want.cpu()).abs().max()))
    if worst > 1e-3:
        raise Fail(f"prompt log-probabilities differ from sdpa's by up to {worst:.2e}")
    return f"{len(prompts)} prompts x 2 chunkings equal sdpa's log-softmax (max error {worst:.1e})"


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}  # fmt: skip
PATTERN = r"(yes|no), [a-z]{2,8}\."


def structured(ctx: Context) -> str:
    if importlib.util.find_spec("llguidance") is None:
        raise Skip("llguidance is not installed (the [structured] extra)")
    from transformers import AutoTokenizer

    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ref = load_model(DEMO_MODEL, "sdpa", ctx.device)
    paged = load_model(DEMO_MODEL, "paged", ctx.device)
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=16, num_blocks=256))
    prompts = [tokenizer(t)["input_ids"] for t in ("A list is", "The for statement", "Python is", "A tuple")]
    new = 24 if ctx.tiny else 48
    free = [engine.add_request(p, max_new_tokens=new // 2) for p in prompts[:2]]
    json_ids = [engine.add_request(p, max_new_tokens=new, structured={"json": SCHEMA}, tokenizer=tokenizer)
                for p in prompts]  # fmt: skip
    regex_ids = [engine.add_request(p, max_new_tokens=new, structured={"regex": PATTERN}, tokenizer=tokenizer)
                 for p in prompts]  # fmt: skip
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    for rid in json_ids:
        text = tokenizer.decode(finals[rid].output_ids, skip_special_tokens=True)
        value = json.loads(text)  # raises on invalid JSON: the check FAILs with it
        if set(value) != {"name", "count"} or not 0 <= value["count"] <= 99:
            raise Fail(f"JSON output {text!r} does not match the schema")
    for rid in regex_ids:
        text = tokenizer.decode(finals[rid].output_ids, skip_special_tokens=True)
        if not re.fullmatch(PATTERN, text):
            raise Fail(f"regex output {text!r} does not match {PATTERN}")
    tol = TIE_TOLERANCE[torch.float32]
    compared = 0
    for i, (rid, p) in enumerate(zip(free, prompts, strict=False)):
        want, gaps = sdpa_greedy(ref, p, new // 2)
        compared += compare_up_to_tie(f"free prompt {i}", finals[rid].output_ids[: len(want)], want, gaps, tol)
    return f"{len(json_ids)} JSON and {len(regex_ids)} regex outputs match; free rows equal sdpa ({compared} steps)"


USES = (
    "hf_paged_attn:SpeculativeConfig(num_speculative_tokens, draft_model, adaptive)",
    "hf_paged_attn:PagedConfig(block_size, num_blocks, max_batch_tokens, speculative)",
    "hf_paged_attn:ContinuousBatchingEngine.add_request(input_ids, params)",
    "hf_paged_attn:SamplingParams(prompt_logprobs, structured, tokenizer, max_new_tokens)",
    "hf_paged_attn:RequestOutput.prompt_logprobs",
    "hf_paged_attn:EngineStats.num_draft_tokens",
    "hf_paged_attn:EngineStats.num_accepted_tokens",
    "hf_paged_attn.demo:DEMO_MODEL",
)
CHECKS = [
    Check("speculative/fp32", speculative, 90, cpu=True, uses=USES),
    Check("prompt-logprobs/fp32", prompt_logprobs, 60, cpu=True, uses=USES),
    Check("structured/fp32", structured, 90, cpu=True, uses=USES),
]
