"""``python -m dsv4jit demo``: the serving-stack flow (pool, schedule, plans shared per ratio, decode
graph) and its comparison with the reference backend.

The CPU tests run the flow on the torch reference backend at a tiny size; they check the schedule,
the result's bookkeeping, the JSON output, and that the comparison catches corrupted caches and
states (and tolerates one-step rounding flips). The GPU test runs the kernels, decode in a CUDA
graph, against the reference backend.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from dsv4jit import cli, runtime
from dsv4jit.demo import DemoConfig, format_result, run_demo
from dsv4jit.demo import run as demo_run
from dsv4jit.demo.check import compare_cache
from dsv4jit.demo.pool import schedule
from dsv4jit.jit import loader

HAS_CUDA = torch.cuda.is_available()
TINY = DemoConfig(requests=2, min_prompt=130, max_prompt=260, chunk=128, decode_steps=12, layers=2, seed=3)


@pytest.fixture(scope="module")
def clean_run():
    """(result, engine under test) of one uncorrupted tiny run on the reference backend."""
    engines = []
    result = run_demo(TINY, "cpu", before_check=engines.append)
    return result, engines[0]


def test_schedule_chunks_prefill_then_decodes_everyone():
    prompts, slots = [300, 5, 129], [4, 0, 2]
    steps = schedule(prompts, slots, chunk=128, decode_steps=3)
    prefill = [s for s in steps if s.kind == "prefill"]
    assert all(s.num_tokens <= 128 for s in prefill) and sum(s.num_tokens for s in prefill) == sum(prompts)
    done = dict.fromkeys(slots, 0)
    for s in prefill:
        for slot, seq, ext in zip(s.slots, s.seq_lens, s.extend_lens):
            assert ext >= 1 and seq - ext == done[slot], "a chunk continues where the previous one stopped"
            done[slot] = seq
    assert done == dict(zip(slots, prompts))
    decode = [s for s in steps if s.kind == "decode"]
    assert [s.seq_lens for s in decode] == [tuple(p + k for p in prompts) for k in (1, 2, 3)]
    assert all(s.slots == tuple(slots) and s.extend_lens == (1, 1, 1) for s in decode)


def test_demo_on_the_reference_backend_matches(clean_run):
    result, _ = clean_run
    assert result.ok and result.backend == "reference"
    assert [p.phase for p in result.phases] == ["prefill", "decode"]
    prefill, decode = result.phases
    assert prefill.tokens == sum(result.prompt_lens) and decode.tokens == TINY.requests * TINY.decode_steps
    assert decode.steps == TINY.decode_steps and prefill.steps >= 2
    # layer 0: c4 core + indexer (fp4); layer 1: c128 core; a state and a cache check each
    assert [(c.layer, c.compressor, c.part) for c in result.checks] == [
        (0, "c4 core", "state"), (0, "c4 core", "cache"), (0, "c4 indexer", "state"), (0, "c4 indexer", "cache"),
        (1, "c128 core", "state"), (1, "c128 core", "cache")]
    assert "indexer_fp4" in result.layer_kinds[0]


def test_demo_report_names_the_cpu_once(clean_run):
    header = format_result(clean_run[0])[0]
    assert header.startswith("dsv4jit demo on the CPU: the torch reference backend") and "(cpu)" not in header


def test_demo_report_gives_tokens_per_second_in_one_format(clean_run):
    result = clean_run[0]
    lines = format_result(result)
    header = next(i for i, line in enumerate(lines) if line.startswith("phase "))
    for phase, line in zip(result.phases, lines[header + 1:]):
        rate = line.split()[-1]
        assert re.fullmatch(r"\d{1,3}(,\d{3})*", rate) and rate == f"{phase.tokens_per_s:,.0f}", line


def test_first_use_is_timed_apart_from_the_steps(monkeypatch):
    """A first load that takes a second (a compile) shows on its own line, and happens in the warm-up,
    never inside a timed step."""
    monkeypatch.setattr(runtime, "_FUNCTIONS", {})
    monkeypatch.setattr(loader, "_MODULES", {})
    load, warm_up = loader._load_uncached, demo_run.warm_up
    in_warm_up, loads_outside = [False], []

    def slow_load(variant, arch):
        if not in_warm_up[0]:
            loads_outside.append(variant.id)
        time.sleep(1.0)
        return load(variant, arch)

    def tracked_warm_up(*args, **kwargs):
        in_warm_up[0] = True
        try:
            return warm_up(*args, **kwargs)
        finally:
            in_warm_up[0] = False

    monkeypatch.setattr(loader, "_load_uncached", slow_load)
    monkeypatch.setattr(demo_run, "warm_up", tracked_warm_up)
    result = run_demo(TINY, "cpu")
    assert result.ok and result.load_seconds >= 1.0
    assert loads_outside == [], "a module was loaded during the timed steps"
    [line] = [line for line in format_result(result) if line.startswith("first use: ")]
    assert line.startswith(f"first use: {result.load_seconds:.2f} s to load the CPU planner")


def test_demo_detects_corrupted_caches_and_states():
    def corrupt(engine):
        core, indexer = engine.layers[0]
        written = core.cache.reshape(-1).nonzero()[0]            # a byte of a stored token
        core.cache.view(-1)[written] ^= 0x40
        indexer.cache[0, 5] = 1                                    # page 0: the padding page, never stored
        engine.layers[1][0].state.view(-1)[7] += 1.0

    result = run_demo(TINY, "cpu", before_check=corrupt)
    assert not result.ok
    failed = {(c.layer, c.compressor, c.part) for c in result.checks if not c.ok}
    assert failed == {(0, "c4 core", "cache"), (0, "c4 indexer", "cache"), (1, "c128 core", "state")}
    details = {(c.layer, c.part): c.detail for c in result.checks if not c.ok}
    assert "outside" in next(c.detail for c in result.checks if c.compressor == "c4 indexer" and not c.ok)
    assert "rows differ" in details[(1, "state")]


def test_cache_comparison_tolerates_one_step_flips_only(clean_run):
    """A single e4m3 code one step off passes (a rounding tie); the same code three steps off, or an
    unwritten token, fails."""
    core = clean_run[1].layers[0][0]
    cache = core.cache.clone()
    page_size = core.spec.page_size
    scales = cache[:, page_size * 576:page_size * 584].reshape(cache.shape[0], page_size, 8)
    page, slot = (scales[..., 0] != 0).nonzero()[0].tolist()     # a stored token
    locs = torch.tensor([page * page_size + slot])
    code_at = (page, slot * 576 + 10)
    code = int(cache[code_at])
    for steps, ok in ((1, True), (3, False)):
        flipped = cache.clone()
        mag = code & 0x7F
        flipped[code_at] = (code & 0x80) | (mag - steps if mag >= steps + 8 else mag + steps)
        assert compare_cache("v4_fp8", page_size, flipped, cache, locs)[0] is ok, steps
    unwritten = cache.clone()
    unwritten[page, page_size * 576 + slot * 8:page_size * 576 + slot * 8 + 7] = 0
    ok, detail = compare_cache("v4_fp8", page_size, unwritten, unwritten, locs)
    assert not ok and "never stored" in detail


@pytest.mark.parametrize("fused", [False, True], ids=["two-step", "fused"])
def test_cli_demo_json(fused, capsys):
    code = cli.main(["demo", "--device", "cpu", "--requests", "1", "--min-prompt", "130", "--max-prompt", "130",
                     "--chunk", "64", "--decode-steps", "3", "--layers", "2", "--indexer-fp8", "--no-progress",
                     "--json"] + ([] if fused else ["--two-step"]))
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["ok"] is True and payload["config"]["fused"] is fused
    assert payload["prompt_lens"] == [130] and payload["config"]["indexer_fp8"] is True
    assert "indexer_fp8" in payload["layer_kinds"][0]
    assert {c["part"] for c in payload["checks"]} == {"state", "cache"} and all(c["ok"] for c in payload["checks"])


@pytest.mark.parametrize("speculative", [False, True], ids=["demo", "speculative"])
def test_a_cpu_demo_warns_of_an_invalid_arch_setting(speculative, capsys, monkeypatch):
    """The CPU demo builds no GPU kernel, so DSV4JIT_CUDA_ARCH does not stop it, but a wrong one is said."""
    monkeypatch.setenv("DSV4JIT_CUDA_ARCH", "garbage")
    code = cli.main(["demo", "--device", "cpu", "--requests", "1", "--min-prompt", "130", "--max-prompt", "130",
                     "--decode-steps", "2", "--layers", "1", "--no-check", "--no-progress", "--json"]
                    + (["--speculative"] if speculative else []))
    assert code == 0
    assert capsys.readouterr().err.startswith("dsv4jit: warning: DSV4JIT_CUDA_ARCH: invalid CUDA arch 'garbage'")


@pytest.mark.parametrize("argv, message", [(["--device", "cpu", "--requests", "0"], "requests"),
                                           (["--device", "cpu", "--min-prompt", "9", "--max-prompt", "8"], "max_prompt"),
                                           (["--device", "tpu"], "device")])
def test_cli_demo_usage_errors_exit_2(argv, message, capsys):
    assert cli.main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("decode_plans, fused", [("in-graph", False), ("copy", False), ("in-graph", True)])
def test_demo_kernels_match_the_reference(decode_plans, fused):
    config = DemoConfig(requests=4, min_prompt=100, max_prompt=700, chunk=512, decode_steps=140, layers=2, seed=11,
                        decode_plans=decode_plans, fused=fused)
    result = run_demo(config, "cuda")
    failed = [c for c in result.checks if not c.ok]
    assert result.ok, "; ".join(f"layer {c.layer} {c.compressor} {c.part}: {c.detail}" for c in failed)
    assert result.backend == "kernels"
    assert [(p.phase, p.mode) for p in result.phases] == [("prefill", "eager"), ("decode", "cuda graph")]
    assert result.phases[1].steps == config.decode_steps - 1       # the first decode step runs before the capture
