"""cascade/fp32: requests decoding together over a shared 96-token prefix take the torch backend's
cascade path (``kernels/torch_backend/decode.py: _decode_cascade``, for groups sharing at least
``CASCADE_MIN_TOKENS``) and match sdpa token for token, up to a near-tie. On CUDA the torch backend
always runs the torch-ops decode; ``--device cpu`` turns the native CPU kernel off
(``cpu_native.library`` returns None) so that the same path runs, with 8 new tokens.
"""

from __future__ import annotations

import torch

from ..base import Check, Context, Fail
from ..helpers import NEW_TOKENS, TIE_TOLERANCE, compare_up_to_tie, load_model, patched, sdpa_greedy

PREFIX = 96


def run(ctx: Context) -> str:
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.kernels import cpu_native
    from hf_paged_attn.kernels.torch_backend import decode as torch_decode

    assert PREFIX >= torch_decode.CASCADE_MIN_TOKENS, "the shared prefix must be long enough to cascade"
    directory = ctx.tiny_llama()
    new = 8 if ctx.tiny else NEW_TOKENS
    ref = load_model(directory, "sdpa", ctx.device)
    paged = load_model(directory, "paged", ctx.device)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(2, ref.config.vocab_size, (PREFIX,), generator=gen).tolist()
    prompts = [prefix + torch.randint(2, ref.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    calls = []
    cascade = torch_decode._decode_cascade

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return cascade(*args, **kwargs)

    # the backend asks for the library at every call; on CUDA it changes nothing
    with patched(cpu_native, "library", lambda: None), patched(torch_decode, "_decode_cascade", counted):
        engine = ContinuousBatchingEngine(paged, PagedConfig(kernel="torch", block_size=16, num_blocks=256))
        engine.generate([prefix + [1]], max_new_tokens=2)  # caches the prefix blocks
        outs = engine.generate(prompts, max_new_tokens=new)
    if not calls:
        raise Fail("the cascade path never ran")
    tol = TIE_TOLERANCE[torch.float32]
    compared = 0
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        want, gaps = sdpa_greedy(ref, p, new)
        compared += compare_up_to_tie(f"prompt {i}", o.output_ids, want, gaps, tol)
    cached = [o.num_cached_tokens for o in outs]
    steps = f"{compared}/{len(prompts) * new} steps compared"
    return f"{len(prompts)} prompts equal sdpa, {steps}; cached {cached}, {len(calls)} cascades"


USES = (
    "hf_paged_attn.kernels.torch_backend.decode:_decode_cascade",
    "hf_paged_attn.kernels.torch_backend.decode:CASCADE_MIN_TOKENS",
    "hf_paged_attn.kernels.cpu_native:library",
    "hf_paged_attn:PagedConfig(kernel, block_size, num_blocks)",
    "hf_paged_attn:RequestOutput.num_cached_tokens",
)
CHECKS = [Check("cascade/fp32", run, 60, cpu=True, uses=USES)]
