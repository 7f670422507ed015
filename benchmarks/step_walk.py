"""Walk one plain decode step of the engine: the package's modules it enters, and the times control climbs
back up to ``runtime/engine.py`` (a return from another module of the package into an engine frame).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/step_walk.py

Two greedy requests on the tests' tiny random Llama, eager forwards on the CPU: a prefill step and a decode
step first, then the walked decode step under ``sys.setprofile``. docs/architecture.md#one-decode-step
quotes its figures.
"""

from __future__ import annotations

import os
import sys
import tempfile
from types import FrameType

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

import hf_paged_attn  # noqa: E402
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn_tools.testing import save_random_model, tiny_llama_config  # noqa: E402

PACKAGE = os.path.dirname(hf_paged_attn.__file__) + os.sep
ENGINE = "runtime/engine.py"


def module_of(frame: FrameType | None) -> str | None:
    """The package module ``frame`` runs in (a path under the package), None outside the package."""
    if frame is None:
        return None
    path = frame.f_code.co_filename
    return path[len(PACKAGE) :] if path.startswith(PACKAGE) else None


def main() -> None:
    path = save_random_model(tiny_llama_config(), tempfile.mkdtemp())
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=torch.float32)
    engine = ContinuousBatchingEngine(model, PagedConfig(num_blocks=64, compile=False))
    greedy = GenerationConfig(do_sample=False, max_new_tokens=20)
    for prompt in ([1, 2, 3, 4], [5, 6, 7]):
        engine.add_request(prompt, generation_config=greedy)
    for _ in range(2):  # the prefill, then a first decode step
        engine.step()

    entered: dict[str, int] = {}  # module -> calls into it from another module
    run: dict[str, int] = {}  # module -> functions run in it
    climbs: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        module, caller = module_of(frame), module_of(frame.f_back)
        if module is None:
            return
        if event == "call":
            run[module] = run.get(module, 0) + 1
            if module != caller:
                entered[module] = entered.get(module, 0) + 1
        elif event == "return" and module != ENGINE and caller == ENGINE:
            climbs.append(f"{module}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    outputs = engine.step()
    sys.setprofile(None)
    engine.shutdown()
    assert len(outputs) == 2 and all(len(o.new_ids) == 1 for o in outputs), outputs
    print(f"modules entered: {len(entered)}")
    for module, count in entered.items():
        print(f"  {module}: entered x{count}, functions run x{run[module]}")
    print(f"climbs back to {ENGINE}: {len(climbs)}")
    for climb in climbs:
        print(f"  {climb}")


if __name__ == "__main__":
    main()
