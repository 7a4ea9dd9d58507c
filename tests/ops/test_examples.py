"""The examples run as a reader runs them (``python examples/<name>.py``), in a child process with
the caller's kernel cache: the CPU example always, the serving step on the CPU (where it says it
falls back) and, marked gpu, on the GPU."""

from __future__ import annotations

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


def test_cpu_example_stores_what_its_steps_close(host_planner):
    prefill, decode = run_example("compress_cpu.py")
    # 299 + 131 prompt tokens close 74 + 32 windows of 4; the decode tokens (positions 299, 131) close one each
    assert prefill == "prefill: 430 tokens, 106 compressed tokens stored"
    assert decode.startswith("decode: request slot 0 holds 33 compressed tokens of 512 values")


def test_serving_step_falls_back_to_the_cpu_and_says_so(host_planner):
    lines = run_example("serving_step.py", "--device", "cpu")
    assert lines[0] == "no CUDA GPU in use: the torch reference backend runs these steps at a small size"
    assert lines[-1] == "every compressor wrote its cache: True"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_step_on_the_gpu():
    lines = run_example("serving_step.py")
    assert lines[0].startswith("warmup: ") and "CUDA graph" in lines[-2]
    assert lines[-1] == "every compressor wrote its cache: True"
