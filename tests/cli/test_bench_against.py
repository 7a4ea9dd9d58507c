"""``--against MODULE`` of the single-op benchmarks (bench/compress.py, bench/store.py,
bench/low_ratio.py): the other implementation's call gets its own planner's plan, the case's tensors
and the store options of the case's format, and writes copies of its own. On the CPU (the reference
backend); the timing needs a GPU (bench/timing.py)."""

from __future__ import annotations

import types

import pytest
import torch

import dsv4jit
from dsv4jit.bench import compress, low_ratio, report, step, store

CPU = torch.device("cpu")


class Recording(types.SimpleNamespace):
    """dsv4jit's API with every call of `names` recorded as (name, args, kwargs)."""

    def __init__(self, *names: str):
        super().__init__(calls=[])
        for name in names:
            setattr(self, name, self._recorded(name, getattr(dsv4jit, name)))
        for planner in ("CompressorDecodePlan", "CompressorPrefillPlan"):
            cls = getattr(dsv4jit, planner)
            setattr(self, planner, types.SimpleNamespace(generate=self._recorded(f"{planner}.generate", cls.generate)))

    def _recorded(self, name, fn):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result
        return call


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_compress_against_runs_the_other_planner_and_op_on_the_same_tensors(decode):
    case = compress.Case("c4", 4, 128, [40, 37], None if decode else [40, 37], decode, dev=CPU)
    other = Recording("compress_forward")
    theirs = case.through(other)
    (planned, _, _, plan), = other.calls  # the plan is built once, when the call is bound
    assert planned == ("CompressorDecodePlan" if decode else "CompressorPrefillPlan") + ".generate"
    theirs()
    name, args, kwargs, out = other.calls[-1]
    assert name == "compress_forward" and args[3] is plan
    assert args[0] is case.state and args[1] is case.input and args[2] is case.ape
    assert kwargs["head_dim"] == 128 and kwargs["compress_ratio"] == 4
    assert out is not case.out and out.shape == (plan[1].shape[0], 128)
    case()
    torch.testing.assert_close(out, case.out, rtol=0, atol=0)  # the same plan rows: the same pooled rows


@pytest.mark.parametrize("fmt, options", [
    ("v4_fp8", dict(layout="v4", use_fp4=False)), ("indexer_fp4", dict(layout="v4", use_fp4=True)),
    ("v41", dict(layout="v41", use_fp4=False)), ("v41_fp4", dict(layout="v41_fp4", use_fp4=False))])
def test_store_against_passes_the_format_s_options(fmt, options):
    case = store.Case(fmt, 16, True, dev=CPU)
    other = Recording("compress_norm_rope_store")
    case.through(other)()
    (_, args, kwargs, _), = other.calls
    assert args == (case.kv, case.plan) and kwargs["kvcache"] is case.kvcache
    assert {k: kwargs[k] for k in options} == options and kwargs["page_size"] == case.page_size
    written = case.kvcache.clone()
    case.kvcache.zero_()
    case()  # dsv4jit's call writes the same bytes
    assert torch.equal(case.kvcache, written) and bool(written.any())


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("layout", ["v41_fp4", "v4"])
@pytest.mark.parametrize("shape", [step.Shape(4, True, 100, 1000, seed=3), step.Shape(2, False, tokens=300)],
                         ids=["decode", "prefill"])
def test_low_ratio_binds_a_call_per_api_on_caches_of_its_own(ratio, layout, shape):
    case = low_ratio.Case(ratio, layout, shape, CPU)
    start = case.layer.parts[0]["cache"]
    other = Recording("c1_decode_norm_rope_store", "c2_decode_norm_rope_store", "c2_prefill_norm_rope_store")
    case.through(other)()
    (name, args, kwargs, _), = other.calls
    expected = "c1_decode" if ratio == 1 else "c2_decode" if shape.decode else "c2_prefill"
    assert name == f"{expected}_norm_rope_store" and kwargs["layout"] == layout
    theirs = args[6 if ratio == 1 else 8]
    assert theirs is not start and not torch.equal(theirs, start)  # written, on a copy
    assert torch.equal(start, case.layer.parts[0]["cache"])
    assert case.bytes > case.batch.num_tokens * 512 * ratio * 2


@pytest.mark.parametrize("module", [compress, store, low_ratio])
def test_the_single_op_benchmarks_take_against_and_need_a_gpu(module, capsys):
    name = module.__name__.rsplit(".", 1)[1]
    assert name in report.discover()
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the module would run")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--against", "dsv4jit", "--only", "nothing"])
    assert exit_.value.code == 2
    assert f"python -m dsv4jit.bench.{name} needs a CUDA GPU" in capsys.readouterr().err
