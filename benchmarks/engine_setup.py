"""What building an engine costs a ``model.generate`` call, which builds one per call (sized for its batch)
and closes it after, so that the model carries nothing of the engine between calls.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_setup.py [--reps 50]

On the bundled demo model (eager forwards, one thread): the median of ``--reps`` calls of a one-token
``model.generate`` of one 8-token prompt, of building and closing an engine sized as that call's
(``ContinuousBatchingEngine(model, num_blocks=4)``), and of the same one-token request on an engine kept
open. Prints the medians and the share of the ``generate`` call that building its engine takes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.demo import DEMO_MODEL  # noqa: E402

EAGER = PagedConfig(compile=False)
PROMPT = [1, 5, 9, 14, 3, 7, 2, 11]


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
    ids = torch.tensor([PROMPT])
    generate = median_ms(lambda: model.generate(ids, max_new_tokens=1, do_sample=False, paged_config=EAGER), args.reps)
    build = median_ms(lambda: ContinuousBatchingEngine(model, EAGER, num_blocks=4).shutdown(), args.reps)
    with ContinuousBatchingEngine(model, EAGER, num_blocks=4) as engine:
        kept = median_ms(lambda: engine.generate([PROMPT], max_new_tokens=1), args.reps)
    print(f"model.generate, one token:           {generate:7.2f} ms")
    print(f"build and close an engine:           {build:7.2f} ms ({build / generate:.0%} of the generate call)")
    print(f"one token on an engine kept open:    {kept:7.2f} ms")


if __name__ == "__main__":
    main()
