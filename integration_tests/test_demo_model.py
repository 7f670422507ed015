"""The bundled demo model: real text through the paged engine, TextStreamer, parity with sdpa."""

from __future__ import annotations

import torch
from transformers import TextStreamer

from hf_paged_attn.demo import main


def test_text_streamer_gets_the_returned_text(demo):
    tokenizer, paged, _ = demo

    class Capture(TextStreamer):
        def __init__(self, tok):
            super().__init__(tok, skip_prompt=True)
            self.text = ""

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.text += text

    streamer = Capture(tokenizer)
    batch = tokenizer(["The for statement"], return_tensors="pt")
    out = paged.generate(**batch, max_new_tokens=24, streamer=streamer)
    new = out[0, batch["input_ids"].shape[1] :]
    assert streamer.text == tokenizer.decode(new, skip_special_tokens=True)
    assert len(streamer.text.split()) >= 5


def test_padded_batch_equals_sdpa_on_the_demo_model(demo):
    tokenizer, paged, ref = demo
    prompts = ["A list is", "The with statement is used to wrap the execution of a block", "Strings"]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    want = ref.generate(**batch, max_new_tokens=30, do_sample=False)
    got = paged.generate(**batch, max_new_tokens=30, do_sample=False)
    assert torch.equal(want, got)


def test_demo_runs_and_prints_text(capsys):
    main(["--num-prompts", "4", "--max-new-tokens", "8", "--no-progress"])
    printed = capsys.readouterr().out
    assert "4 requests" in printed and "tokens/s" in printed
    assert "The for statement" in printed
