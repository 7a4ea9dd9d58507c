"""bench/step.py: a whole forward step's compressor work, built for each model and shape. On the CPU
(the reference backend) a step of one layer per ratio runs through dsv4jit and through an API that
has only the two-step ops, as ``--against`` runs another implementation: both write the same caches,
and every layer's cache is written. The timing needs a GPU (bench/timing.py)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import dsv4jit
from dsv4jit.bench import report, step

CPU = torch.device("cpu")
TWO_STEP_ONLY = types.SimpleNamespace(**{name: getattr(dsv4jit, name) for name in (
    "CompressorDecodePlan", "CompressorPrefillPlan", "compress_forward", "compress_norm_rope_store",
    "c1_decode_norm_rope_store", "c2_decode_norm_rope_store", "c2_prefill_norm_rope_store")})


def test_the_models_layer_counts():
    assert sum(step.MODELS["pro"].layers.values()) == 61 and sum(step.MODELS["flash"].layers.values()) == 41
    assert step.MODELS["pro-online"].layers == step.MODELS["pro"].layers and step.MODELS["pro-online"].online
    assert step.MODELS["v4.1"].layers == {4: 11, 128: 10, 1: 10, 2: 10}  # 43 layers, 2 without a compressor


@pytest.mark.parametrize("model", list(step.MODELS))
@pytest.mark.parametrize("shape", [step.Shape(4, True, 100, 1000, seed=3), step.Shape(2, False, tokens=300)],
                         ids=["decode", "prefill"])
def test_a_step_writes_the_same_caches_through_either_path(model, shape):
    full = step.MODELS[model]
    small = dataclasses.replace(full, layers={ratio: 1 for ratio in full.layers})
    s = step.Step(small, shape, CPU)
    # an online c128 layer keeps one (max, sum, average) row a request, which the ring ops reject
    c128_states = [tuple(layer.parts[0]["state"].shape[1:]) for layer in s.layers if layer.ratio == 128]
    assert c128_states == ([(1, 3 * 512)] if full.online else [(128, 2 * 512)])
    starts = [part["cache"].clone() for layer in s.layers for part in layer.parts]
    ours, theirs = s.bind(dsv4jit), s.bind(TWO_STEP_ONLY)
    ours.run()
    theirs.run()
    assert step.differing_share(ours.caches, theirs.caches) == 0.0
    two_step_launches = {4: 4, 128: 2, 1: 1, 2: 1}  # a c4 layer: core and indexer, compress then store each
    assert ours.launches == len(s.layers) == len(ours.calls)
    assert theirs.launches == sum(two_step_launches[layer.ratio] for layer in s.layers)
    written = [bool((cache != start).any()) for cache, start in zip(ours.caches, starts)]
    ratios = [layer.ratio for layer in s.layers for _ in layer.parts]
    # a decode step stores a c128 row only for a request at a boundary: none in this batch
    assert written == [not (shape.decode and r == 128) for r in ratios]


def test_the_step_benchmark_is_discovered_and_needs_a_gpu_alone(capsys):
    assert "step" in report.discover()
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the module would run")
    with pytest.raises(SystemExit) as exit_:
        step.main(["--only", "v4.1"])
    assert exit_.value.code == 2
    assert "python -m dsv4jit.bench.step needs a CUDA GPU" in capsys.readouterr().err
