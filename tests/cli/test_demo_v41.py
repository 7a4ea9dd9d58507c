"""``python -m dsv4jit demo --model v4.1``: layers of ratios 4, 128, 1 and 2 storing V4.1 layouts
through prefill, decode and a speculative verify step, compared with the reference backend.

On the CPU the flow runs on the reference backend (both sides): these tests check its bookkeeping,
the JSON output and that the comparison catches a corrupted cache, state ring or pair ring of each
kind of layer. The GPU test runs the kernels against the reference backend.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv4jit import cli
from dsv4jit.demo.v41 import V41Config, format_v41, run_v41

HAS_CUDA = torch.cuda.is_available()
TINY = V41Config(requests=2, min_prompt=130, max_prompt=260, chunk=128, decode_steps=5, layers=4,
                 verify_tokens=3, seed=5)
CPU = torch.device("cpu")
PARTS = {(0, "c4 core", "state"), (0, "c4 core", "cache"), (0, "c4 indexer", "state"), (0, "c4 indexer", "cache"),
         (1, "c128 core", "state"), (1, "c128 core", "cache"), (2, "c1 core", "cache"), (3, "c2 core", "ring"),
         (3, "c2 core", "cache")}


def test_every_layer_kind_is_checked_and_matches():
    result = run_v41(TINY, CPU)
    assert result.ok and {(c.layer, c.compressor, c.part) for c in result.checks} == PARTS
    assert [p.phase for p in result.phases] == ["prefill", "decode", "verify"]
    assert result.phases[2].tokens == TINY.requests * TINY.verify_tokens
    assert all("no tokens stored" not in c.detail for c in result.checks if c.part == "cache")
    assert format_v41(result)[-1] == "every state, ring and cache matched"


def test_corrupted_caches_and_rings_are_caught():
    def corrupt(engine):
        core = engine.v4.layers[0][0]
        written = core.cache.reshape(-1).nonzero()[0]  # a byte of a stored token (v41 layout)
        core.cache.view(-1)[written] ^= 0x40
        c1, c2 = engine.low
        c1.cache[0, 3] = 1  # page 0: the padding page, never stored
        c2.ring[5, 7] += 1.0

    result = run_v41(TINY, CPU, before_check=corrupt)
    failed = {(c.layer, c.compressor, c.part) for c in result.checks if not c.ok}
    assert not result.ok and failed == {(0, "c4 core", "cache"), (2, "c1 core", "cache"), (3, "c2 core", "ring")}


def test_cli_v41_demo_json(capsys):
    code = cli.main(["demo", "--model", "v4.1", "--device", "cpu", "--requests", "1", "--min-prompt", "130",
                     "--max-prompt", "130", "--chunk", "64", "--decode-steps", "2", "--verify-tokens", "2",
                     "--no-progress", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["ok"] is True and payload["config"]["verify_tokens"] == 2
    assert payload["layer_kinds"] == ["c4 (core v41, indexer indexer_fp4)", "c128 (v41)", "c1 (v41_fp4)", "c2 (v41_fp4)"]


def test_cli_v41_demo_usage_error(capsys):
    assert cli.main(["demo", "--model", "v4.1", "--device", "cpu", "--verify-tokens", "9"]) == 2
    assert "verify_tokens" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_v41_demo_kernels_match_the_reference():
    config = V41Config(requests=4, min_prompt=100, max_prompt=700, chunk=512, decode_steps=20, layers=8, seed=11)
    result = run_v41(config, torch.device("cuda"))
    failed = [c for c in result.checks if not c.ok]
    assert result.ok, "; ".join(f"layer {c.layer} {c.compressor} {c.part}: {c.detail}" for c in failed)
    assert result.backend == "kernels"
