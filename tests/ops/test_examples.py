"""The examples run as a reader runs them (``python examples/<name>.py``), in a child process with
the caller's kernel cache: the CPU example always, the serving step on the CPU (where it says it
falls back) and, marked gpu, on the GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> list[str]:
    res = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.splitlines()


def test_cpu_example_stores_what_its_steps_close_and_checks_it(host_planner):
    prefill, decode, check = run_example("compress_cpu.py")
    # 299 + 131 prompt tokens close 74 + 32 windows of 4; the decode tokens (positions 299, 131) close one each
    assert prefill == "prefill: 430 tokens, 106 compressed tokens stored"
    assert decode.startswith("decode: request slot 0 holds 33 compressed tokens of 512 values")
    assert check == ("PASS: compress_and_store wrote what compress_forward and compress_norm_rope_store write, "
                     "and request slot 0 holds all 33 of its compressed tokens")


def test_serving_step_falls_back_to_the_cpu_and_says_so(host_planner):
    lines = run_example("serving_step.py", "--device", "cpu")
    assert lines[0] == "no CUDA GPU in use: the torch reference backend runs these steps at a small size"
    assert lines[1] == "warmup: 1 variant loaded"
    assert lines[-1] == "PASS: every state and cache matches a second run on the reference backend (3 compressors)"


def test_the_examples_fail_when_their_check_fails(host_planner, tmp_path):
    """The pass lines are checks: a run whose result is spoiled says FAIL and exits 1."""
    for name, spoil, args in (("compress_cpu.py", "cache[1, 0] ^= 1", []),
                              ("serving_step.py", "got[0][0].cache[0, 0] ^= 1", ["--device", "cpu"])):
        source = (EXAMPLES / name).read_text()
        indent, marker = re.search(r"\n( *)(# --- check)", source).groups()
        (tmp_path / name).write_text(source.replace(f"{indent}{marker}", f"{indent}{spoil}\n{indent}{marker}", 1))
        res = subprocess.run([sys.executable, str(tmp_path / name), *args], capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 1 and res.stdout.splitlines()[-1].startswith("FAIL: "), (name, res.stdout, res.stderr)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_step_on_the_gpu():
    lines = run_example("serving_step.py")
    assert lines[0].startswith("warmup: ") and any("CUDA graph" in line for line in lines)
    assert lines[-1] == "PASS: every state and cache matches the reference backend (3 compressors)"
