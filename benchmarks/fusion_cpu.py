"""Candidate not kept: q/k/v and gate/up projections fused at load time, timed against the plain model.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fusion_cpu.py [--threads 2]

``fuse_projections(model)`` concatenates the weights of sibling projections (``q_proj``/``k_proj``/
``v_proj``, ``gate_proj``/``up_proj``) into one weight; the first sibling called with an input
computes the fused product, the others return their columns of it when called with the very same
input tensor. The bench times the model body (sdpa, no cache) of the bundled demo model and of the
bench's 30M Llama, plain and fused, alternating, at 64 rows (decode-sized) and 512 tokens (prefill).
On the 2-core machine of benchmarks/README.md the fused model was 1-9% *slower* in every case (the
split outputs are strided views, which the following reshapes, rotary and activations pay for), so
the engine does not fuse.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.bench.workloads import FULL_MODEL

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The concatenated weight (and bias) of sibling projections and the last fused product."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = torch.cat([m.weight.detach() for m in linears])  # [sum(out), in]
        biases = [m.bias for m in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype, device=m.weight.device)
             for m, b in zip(linears, biases)]
        )  # fmt: skip
        self.sizes = [m.out_features for m in linears]
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor | None] = []

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection ``index`` of ``x``: from the fused product when its siblings already asked for this ``x``."""
        if x is not self._input or self._parts[index] is None:
            self._input = x
            self._parts = list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        out, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):
            self._input = None  # every sibling served: keep nothing alive
        return out


class FusedLinear(nn.Module):
    """One projection of a :class:`FusedGroup`; its weight is a view of the fused weight."""

    def __init__(self, group: FusedGroup, index: int, original: nn.Linear) -> None:
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = original.in_features, original.out_features
        start = sum(group.sizes[:index])
        self.weight = nn.Parameter(group.weight[start : start + self.out_features], requires_grad=False)
        self.bias = (
            None if original.bias is None
            else nn.Parameter(group.bias[start : start + self.out_features], requires_grad=False)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index}"


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of plain ``nn.Linear`` siblings with one input size, dtype
    and device (idempotent). Returns the number of groups fused by this call."""
    fused = 0
    for module in model.modules():
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(m) is nn.Linear for m in linears):  # absent, already fused, or quantised
                continue
            first = linears[0]
            if any(
                m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                or m.weight.device != first.weight.device for m in linears
            ):  # fmt: skip
                continue
            group = FusedGroup(linears)
            for index, (name, linear) in enumerate(zip(names, linears)):
                setattr(module, name, FusedLinear(group, index, linear))
            fused += 1
    return fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter  # CPU time is steadier on one thread
    directory = tempfile.mkdtemp(prefix="hf_paged_attn_fusion_")
    FULL_MODEL.save(directory)
    for name, path in [("demo 4.2M", DEMO_MODEL), ("bench 30M", directory)]:
        plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        fused = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        groups = fuse_projections(fused)
        for rows in (64, 512):
            x = torch.randint(0, 200, (rows, 1) if rows == 64 else (1, rows))  # 64 one-token rows, or one prompt

            def timed(model: nn.Module, x: torch.Tensor = x) -> float:
                with torch.inference_mode():
                    start = clock()
                    model.model(x)
                    return clock() - start

            with torch.inference_mode():
                same = torch.allclose(plain.model(x).last_hidden_state, fused.model(x).last_hidden_state, atol=1e-4)
            a, b = [], []
            for _ in range(args.reps):
                a.append(timed(plain))
                b.append(timed(fused))
            ma, mb = 1e3 * statistics.median(a), 1e3 * statistics.median(b)
            print(f"{name} ({groups} groups fused), {rows} tokens, {args.threads} threads: plain {ma:.2f} ms, "
                  f"fused {mb:.2f} ms, fused is {ma / mb:.3f}x (same output: {same})")  # fmt: skip


if __name__ == "__main__":
    main()
