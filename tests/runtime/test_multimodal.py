"""Vision-language models: images through generate and the engine equal sdpa; the prefix cache keys
image blocks by the image's content."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.request import Request
from hf_paged_attn.runtime.multimodal import split_images
from hf_paged_attn_tools.tiny_vlms import BUILDERS, random_image

NEW = 8


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def vlm(request):
    return BUILDERS[request.param]()


def sdpa_generate(model: torch.nn.Module, inputs: dict, **kwargs) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    try:
        return model.generate(**inputs, **{"max_new_tokens": NEW, "do_sample": False, **kwargs})
    finally:
        model.set_attn_implementation("paged")


def paged_generate(model: torch.nn.Module, inputs: dict, **kwargs) -> torch.Tensor:
    model.set_attn_implementation("paged")
    return model.generate(**inputs, **{"max_new_tokens": NEW, "do_sample": False, **kwargs})


def test_generate_mixes_image_and_text_rows(vlm):
    img = vlm.image_text
    texts = [f"{img} describe this", "a row of text alone", f"{img} and {img} compare them"]
    inputs = vlm.inputs(texts, [random_image(1), random_image(2, 16, 16), random_image(3, 24, 16)])
    want = sdpa_generate(vlm.model, inputs)
    assert torch.equal(paged_generate(vlm.model, inputs), want)
    # the images matter: another image in row 0 changes sdpa's tokens there (so parity above is not vacuous)
    other = vlm.inputs(texts, [random_image(9), random_image(2, 16, 16), random_image(3, 24, 16)])
    assert not torch.equal(sdpa_generate(vlm.model, other)[0], want[0])


@pytest.mark.parametrize("options", [dict(num_beams=2), dict(num_return_sequences=2, do_sample=True, top_k=1)],
                         ids=["beams", "return_sequences"])  # fmt: skip
def test_generate_with_beams_and_sequences(options):
    """Beams and forked sequences carry their request's images (and M-RoPE positions) with them."""
    for name in ("llava", "qwen2_vl"):
        vlm = BUILDERS[name]()
        inputs = vlm.inputs([f"{vlm.image_text} describe", "a row of text"], [random_image(1)])
        assert torch.equal(paged_generate(vlm.model, inputs, **options), sdpa_generate(vlm.model, inputs, **options))


def engine_inputs(vlm, seed: int, text: str = "what is in the picture") -> tuple[list[int], dict]:
    inputs = vlm.inputs([f"{vlm.image_text} {text}"], [random_image(seed)])
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask")
    return ids, inputs


def run(engine: ContinuousBatchingEngine, ids: list[int], images: dict):
    rid = engine.add_request(ids, max_new_tokens=NEW, **images)
    (final,) = [o for o in engine.stream() if o.finished and o.request_id == rid]
    return final


def test_engine_chunked_prefill_prefix_cache_by_image(vlm):
    """Chunks of 5 tokens split each image's tokens; the encoder runs once per request; the same image
    and prompt hit the cache, another image never does."""
    engine = ContinuousBatchingEngine(
        vlm.model, PagedConfig(block_size=4, num_blocks=64, max_batch_tokens=5, enable_prefix_caching=True)
    )
    ids, images = engine_inputs(vlm, seed=1)
    want = sdpa_generate(vlm.model, {"input_ids": torch.tensor([ids]), **images})[0, len(ids) :].tolist()
    first = run(engine, ids, images)
    assert first.output_ids == want and first.num_cached_tokens == 0
    again = run(engine, ids, images)
    assert again.output_ids == want
    assert again.num_cached_tokens == 4 * ((len(ids) - 1) // 4) > 0  # every full block before the last token
    other_ids, other_images = engine_inputs(vlm, seed=5)
    assert other_ids == ids  # same tokens: only the pixels differ
    other = run(engine, other_ids, other_images)
    assert other.num_cached_tokens == 0
    other_want = sdpa_generate(vlm.model, {"input_ids": torch.tensor([ids]), **other_images})[0, len(ids) :]
    assert other.output_ids == other_want.tolist()


def test_engine_encodes_once_per_prefill_and_again_after_preemption(vlm):
    """Preempted mid-prefill, a request keeps its unconsumed features; preempted after its prefill, it
    runs the encoder again. Its tokens equal sdpa's either way."""
    # chunks of 3 tokens: shorter than every family's image (4 tokens and up), so one ends inside it
    config = PagedConfig(block_size=4, num_blocks=64, max_batch_tokens=3, enable_prefix_caching=False)
    engine = ContinuousBatchingEngine(vlm.model, config)  # no cache: a preempted request computes everything again
    ids, images = engine_inputs(vlm, seed=2)
    rid = engine.add_request(ids, max_new_tokens=NEW, **images)
    request = engine.intake.live[rid]
    outputs = []
    while request.multimodal.num_encodes == 0:  # until a chunk feeds the image's first tokens
        outputs += engine.step()
    assert request.multimodal.embeds is not None
    assert request.num_computed_tokens <= int(request.multimodal.positions[-1])  # its last is still to come
    engine.scheduler.recompute_all()  # preempted: its K/V goes, and is computed again from the prompt
    while request.num_computed_tokens <= len(ids):  # the prefill, and one decode step
        outputs += engine.step()
    assert request.multimodal.num_encodes == 1 and request.multimodal.embeds is None  # consumed, dropped
    engine.scheduler.recompute_all()
    outputs += [o for o in engine.stream()]
    assert request.multimodal.num_encodes == 2
    final = [o for o in outputs if o.finished][0]
    want = sdpa_generate(vlm.model, {"input_ids": torch.tensor([ids]), **images})[0, len(ids) :]
    assert final.output_ids == want.tolist()


def test_images_that_do_not_match_the_prompt_are_refused(vlm):
    ids, images = engine_inputs(vlm, seed=1)
    with pytest.raises(ValueError, match="image tokens|rows of images"):
        split_images(vlm.model, [ids, ids], images)  # two prompts' image tokens, one image
    with pytest.raises(ValueError, match="no pixel_values"):
        split_images(vlm.model, [ids], {})
    with pytest.raises(NotImplementedError, match="pixel_values_videos"):
        split_images(vlm.model, [ids], {**images, "pixel_values_videos": images["pixel_values"]})


def test_images_for_an_unchecked_family_are_refused_by_name(vlm, monkeypatch):
    ids, images = engine_inputs(vlm, seed=1)
    monkeypatch.setattr(vlm.model.config, "model_type", "paligemma")  # its image tokens attend bidirectionally
    with pytest.raises(NotImplementedError, match="paligemma"):
        split_images(vlm.model, [ids], images)


def test_block_extra_names_the_images_a_block_holds():
    request = Request("r", list(range(12)), 4, None, arrival=0, mm_spans=((2, 2, b"A"), (9, 2, b"B")))
    assert request.block_extra(0, 4) == (2).to_bytes(8, "little") + b"A"
    assert request.block_extra(4, 8) == b""
    assert request.block_extra(8, 12) == (9).to_bytes(8, "little") + b"B"
    assert Request("t", [1, 2], 4, None, arrival=0).block_extra(0, 4) == b""


def test_requests_admitted_together_run_the_tower_once(vlm, monkeypatch):
    """Three requests whose prefills reach their images in one step: one batched vision-tower call, and each
    request's tokens equal sdpa's on its own prompt."""
    engine = ContinuousBatchingEngine(vlm.model, PagedConfig(block_size=4, num_blocks=128, max_batch_tokens=512))
    prompts = [engine_inputs(vlm, seed=seed) for seed in (3, 4, 5)]
    calls = []
    tower = vlm.model.get_image_features
    monkeypatch.setattr(vlm.model, "get_image_features", lambda **kw: calls.append(1) or tower(**kw))
    rids = [engine.add_request(ids, max_new_tokens=NEW, **images) for ids, images in prompts]
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    assert len(calls) == 1
    for rid, (ids, images) in zip(rids, prompts):
        want = sdpa_generate(vlm.model, {"input_ids": torch.tensor([ids]), **images})[0, len(ids) :]
        assert finals[rid].output_ids == want.tolist()


@pytest.mark.parametrize("name", [n if n in ("llava", "qwen2_vl") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(BUILDERS)])  # fmt: skip
def test_compiled_engine_runs_image_steps_through_the_graph(name):
    """``compile="startup"`` compiles a graph per kind of step (ids; image features in ``inputs_embeds``; M-RoPE's
    3-D positions), so every step of image requests, text-only rows beside them, runs compiled; tokens equal sdpa's."""
    vlm = BUILDERS[name]()
    config = PagedConfig(block_size=4, num_blocks=128, max_batch_tokens=7, compile="startup", progress_bar=False)
    prompts = [engine_inputs(vlm, seed=s, text=t) for s, t in ((1, "describe"), (2, "what is in the picture here"))]
    text_ids = vlm.inputs(["a row of text alone"], [])["input_ids"][0].tolist()
    wants = [sdpa_generate(vlm.model, {"input_ids": torch.tensor([ids]), **images})[0, len(ids) :].tolist()
             for ids, images in prompts]  # fmt: skip
    wants.append(sdpa_generate(vlm.model, {"input_ids": torch.tensor([text_ids])})[0, len(text_ids) :].tolist())
    with ContinuousBatchingEngine(vlm.model, config) as engine:
        executor = getattr(engine.executor, "inner", engine.executor)
        assert executor.graph_ready
        rids = [engine.add_request(ids, max_new_tokens=NEW, **images) for ids, images in prompts]
        rids.append(engine.add_request(text_ids, max_new_tokens=NEW))
        got = {o.request_id: o.output_ids for o in engine.stream() if o.finished}
        assert executor.num_compiled_steps == engine.stats.num_steps > 0
    assert [got[r] for r in rids] == wants
