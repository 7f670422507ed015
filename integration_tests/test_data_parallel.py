"""The data-parallel recipe (examples/data_parallel.py) under ``accelerate launch`` with two CPU processes.

``accelerate launch --cpu --num_processes 2`` starts one process unless mpirun and a hostfile are
configured (accelerate#2741), so the test uses accelerate's torchrun launcher (``--multi_gpu``) and
the recipe's ``--cpu`` (``PartialState(cpu=True)``: gloo between the processes). Every wait is
bounded and the whole process group is killed on timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged_attn.demo import DEMO_MODEL, PROMPTS
from hf_paged_attn_tools.testing import compare_greedy, reference_greedy

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 12
TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers: they share its session
        out, _ = proc.communicate()
        raise AssertionError(f"accelerate launch did not finish in {TIMEOUT}s:\n{out[-3000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out)


def test_two_processes_gather_what_one_generates(tmp_path):
    prompts = PROMPTS[:5]  # odd: the shares are uneven (3 + 2)
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out_file = tmp_path / "out.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HOME": str(tmp_path / "hf_home"),  # no user accelerate config, no hub cache
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # gloo over loopback only
    }
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
        "examples/data_parallel.py",
        "--cpu", "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", str(NEW_TOKENS),
        "--out", str(out_file),
    ]  # fmt: skip
    result = launch(command, env)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "5 prompts over 2 processes on cpu" in result.stdout, result.stdout[-3000:]
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts  # input order
    assert [r["rank"] for r in rows] == [0, 0, 0, 1, 1]  # really split over two processes

    # against transformers' own greedy (sdpa), prompt by prompt: no padding, nothing of ours
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    expected = [reference_greedy(ref, ids, NEW_TOKENS) for ids in encoded]
    problems = compare_greedy(ref, encoded, expected, [r["output_ids"] for r in rows])
    assert not problems, "\n".join(problems)
