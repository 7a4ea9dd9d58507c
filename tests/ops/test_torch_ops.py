"""The public ops as torch custom ops: torch.compile traces them without graph breaks and matches
eager, fake tensors give the right outputs, the schemas declare every mutated argument, and the ops
capture into CUDA graphs.

CPU tests use the torch reference backend (the custom op's real implementation on CPU tensors);
GPU tests (marked gpu) the kernels. Compiled and eager runs start from identical inputs and must
give bit-identical outputs, state pools and caches: the op is opaque, so compiling changes nothing
about the arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4jit.ops  # noqa: F401  (registers every custom op)
from dsv4jit import CompressorDecodePlan, CompressorPrefillPlan, compress_forward, compress_norm_rope_store
from dsv4jit.geometry import page_bytes
from helpers.compressor_step import (RING, Step, assert_same_result, fused_pipeline, make_step, pipeline,
                                     planner_inputs, run)
from helpers.pool_utils import SWA_PAGE

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
OPS = {torch.ops.dsv4jit.compress.default, torch.ops.dsv4jit.norm_rope_store.default,
       torch.ops.dsv4jit.compress_and_store.default}

# (ratio, head_dim, use_fp4): V4 latent c4 and c128, and the c4 indexer (fp8 and fp4).
CONFIGS = [(4, 512, False), (128, 512, False), (4, 128, False), (4, 128, True)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test traces from scratch: dynamo's memory of the shapes an earlier test compiled `pipeline`
    with (in this worker) would otherwise make dimensions symbolic here and add their guards' ops."""
    torch._dynamo.reset()


def config_id(config) -> str:
    ratio, hd, fp4 = config
    return f"c{ratio}-hd{hd}" + ("-fp4" if fp4 else "")


class Recorder:
    """A torch.compile backend that keeps the FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self) -> list:
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def compiled_vs_eager(step: Step, backend, fn=pipeline) -> None:
    eager, compiled = step.fresh(), step.fresh()
    out_eager = run(eager, fn)
    out_compiled = run(compiled, torch.compile(fn, backend=backend, fullgraph=True))
    assert_same_result(compiled, out_compiled, eager, out_eager)
    assert not torch.equal(eager.kvcache.cpu(), step.kvcache.cpu()), "the step stored nothing: a vacuous test"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [pipeline, fused_pipeline], ids=["two-step", "fused"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compile_aot_eager_matches_eager(device, fn, decode, config):
    ratio, hd, fp4 = config
    compiled_vs_eager(make_step(device, ratio=ratio, head_dim=hd, use_fp4=fp4, decode=decode), "aot_eager", fn)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_holds_one_custom_op_per_public_op(device):
    """fullgraph=True already fails on a graph break; this also checks that the trace recorded the
    custom ops (not their implementations) and nothing else that touches data."""
    step = make_step(device, decode=True)
    recorder = Recorder()
    run(step.fresh(), torch.compile(pipeline, backend=recorder, fullgraph=True))
    targets = recorder.ops()
    assert len(recorder.graphs) == 1
    assert [t for t in targets if t in OPS] == [torch.ops.dsv4jit.compress.default,
                                               torch.ops.dsv4jit.norm_rope_store.default]
    assert set(targets) <= OPS | {torch.empty, torch.view_as_real}, targets  # freq_cis goes in as its real view


def test_compile_with_out_and_a_flat_state_buffer():
    step = make_step("cpu", ratio=4, head_dim=128, seed=3)

    def fn(state, x, ape, plan, out):
        compress_forward(state.view(-1, state.shape[-1]), x, ape, plan, head_dim=128, compress_ratio=4, out=out)
        return out

    eager, compiled = step.fresh(), step.fresh()
    rows = step.plan.plan_c.shape[0]
    out_eager = fn(eager.state, eager.x, eager.ape, eager.plan, torch.full((rows, 128), float("nan")))
    out_compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(
        compiled.state, compiled.x, compiled.ape, compiled.plan, torch.full((rows, 128), float("nan")))
    assert torch.equal(out_compiled, out_eager)
    assert torch.equal(compiled.state, eager.state)


def test_compile_dynamic_batch():
    """One graph with a symbolic batch serves decode steps of two batch sizes."""
    compiled = torch.compile(pipeline, backend="aot_eager", fullgraph=True, dynamic=True)
    for batch in (3, 5):
        step = make_step("cpu", ratio=4, head_dim=128, decode=True, batch=batch, seed=batch)
        eager, mine = step.fresh(), step.fresh()
        assert_same_result(mine, run(mine, compiled), eager, run(eager))


def test_fake_tensors_give_output_shape_dtype_device():
    step = make_step("cpu", ratio=128, head_dim=512)
    with FakeTensorMode() as mode:
        state, x, ape, plan_c, plan_w, kvcache = (mode.from_tensor(t) for t in (
            step.state, step.x, step.ape, step.plan.plan_c, step.plan.plan_w, step.kvcache))
        plan = CompressorPrefillPlan(128, plan_c, plan_w, None, step.plan.num_q_tokens)
        out = compress_forward(state, x.to(torch.bfloat16), ape, plan, head_dim=512, compress_ratio=128)
        stored = compress_norm_rope_store(out, plan, norm_weight=mode.from_tensor(step.weight), norm_eps=1e-6,
                                          freq_cis=mode.from_tensor(step.freq_cis),
                                          out_loc=mode.from_tensor(step.out_loc), kvcache=kvcache, page_size=2)
    assert out.shape == (step.plan.plan_c.shape[0], 512)
    assert out.dtype == torch.bfloat16 and out.device == step.x.device
    assert stored is None


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_opcheck(decode):
    """torch.library.opcheck: the schema's mutation annotations match what the implementation writes
    (and nothing else is written), the fake implementation agrees with the real one, and the op
    works under AOT dispatch with static and dynamic shapes."""
    step = make_step("cpu", ratio=4, head_dim=128, decode=decode, seed=5)
    out = torch.empty(step.plan[1].shape[0], 128)
    plan_w = None if decode else step.plan.plan_w
    reads_state = decode or step.plan.reads_state
    torch.library.opcheck(torch.ops.dsv4jit.compress.default,
                          (step.state, step.x, step.ape, step.plan[1], plan_w, out, 128, 4, decode, reads_state))
    kv = compress_forward(step.state.clone(), step.x, step.ape, step.plan, head_dim=128, compress_ratio=4)
    num_q = -1 if decode else step.plan.num_q_tokens
    freq = torch.view_as_real(step.freq_cis).flatten(1)  # the ops take the real (cos, sin) table
    torch.library.opcheck(torch.ops.dsv4jit.norm_rope_store.default,
                          (kv, step.plan.plan_rows, step.weight, freq, step.out_loc, step.kvcache, None,
                           "indexer_fp8", step.page_size, 4, decode, 1e-6, num_q))
    torch.library.opcheck(torch.ops.dsv4jit.compress_and_store.default,
                          (step.state, step.x, step.ape, step.plan.plan_rows, plan_w, step.weight, freq,
                           step.out_loc, step.kvcache, None, "indexer_fp8", step.page_size, 128, 4, decode, 1e-6,
                           num_q, reads_state))


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_opcheck_online(decode):
    """opcheck of the online c128 ops (compress_forward and compress_and_store with is_online=True) on a
    step whose requests cross a 128-token chunk (so rows are emitted and stored)."""
    gen = torch.Generator().manual_seed(3)
    hd, slots = 512, 6
    rpi = torch.tensor([4, 1, 2])
    r2t = torch.zeros(slots, 4, dtype=torch.int32)
    state = torch.cat([torch.randn(slots, 1, hd, generator=gen), 1 + torch.rand(slots, 1, hd, generator=gen),
                       torch.randn(slots, 1, hd, generator=gen)], dim=-1)
    if decode:
        plan = CompressorDecodePlan.generate_online(torch.tensor([128, 300, 256]), rpi, r2t)
    else:
        ext = torch.tensor([130, 5, 128])
        plan = CompressorPrefillPlan.generate_online(torch.tensor([130, 260, 256]), ext, rpi, r2t, int(ext.sum()))
    plan_w = None if decode else plan.plan_w
    x = torch.randn(3 if decode else plan.num_q_tokens, 2 * hd, generator=gen)
    ape = torch.randn(128, hd, generator=gen)
    out = torch.empty(plan.plan_rows.shape[0], hd)
    torch.library.opcheck(torch.ops.dsv4jit.compress_online.default,
                          (state, x, ape, plan.plan_rows, plan_w, out, hd, decode))
    angles = torch.rand(512, 32, generator=gen)
    freq = torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(1)
    out_loc = torch.randperm(x.shape[0], generator=gen)
    kvcache = torch.zeros(x.shape[0] // 2 + 1, page_bytes("v4_fp8", 2), dtype=torch.uint8)
    num_q = -1 if decode else plan.num_q_tokens
    args = (state, x, ape, plan.plan_rows, plan_w, 1 + torch.rand(hd, generator=gen), freq, out_loc, kvcache, None,
            "v4_fp8", 2, hd, 128, decode, 1e-6, num_q, True, True)  # reads_state, is_online
    torch.library.opcheck(torch.ops.dsv4jit.compress_and_store.default, args)
    torch.ops.dsv4jit.compress_and_store.default(*args)
    assert kvcache.any(), "the step stored nothing: a vacuous test"


def test_dispatch_modes_see_the_custom_ops():
    """Eager calls skip the dispatcher, but under a dispatch mode (what make_fx, export and fake
    tensors use) the public ops go through torch.ops.dsv4jit."""
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    step = make_step("cpu", ratio=4, head_dim=128, decode=True)
    eager, logged = step.fresh(), step.fresh()
    out_eager = run(eager)
    with Log():
        out_logged = run(logged)
    assert [f for f in seen if f in OPS] == [torch.ops.dsv4jit.compress.default,
                                            torch.ops.dsv4jit.norm_rope_store.default]
    assert_same_result(logged, out_logged, eager, out_eager)


def dispatcher_events(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("dsv4jit::")]


def test_eager_calls_skip_the_dispatcher():
    """The dispatcher costs tens of µs per custom-op call on the host; eager calls go straight to
    the implementation (the profiler records every dispatcher call of a dsv4jit op)."""
    step = make_step("cpu", ratio=4, head_dim=128, decode=True)
    assert dispatcher_events(lambda: run(step.fresh())) == []
    fresh = step.fresh()
    out = torch.empty(fresh.x.shape[0], 128)
    assert dispatcher_events(lambda: torch.ops.dsv4jit.compress.default(
        fresh.state, fresh.x, fresh.ape, fresh.plan.plan_d, None, out, 128, 4, True, True)) == ["dsv4jit::compress"]


# ---------------------------------------------------------------------------------------------
# GPU: inductor and CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fn", [pipeline, fused_pipeline], ids=["two-step", "fused"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compile_inductor_matches_eager(fn, decode, config):
    pytest.importorskip("triton", reason="inductor needs triton")
    ratio, hd, fp4 = config
    step = make_step("cuda", ratio=ratio, head_dim=hd, use_fp4=fp4, decode=decode, seed=7)
    compiled_vs_eager(step, "inductor", fn)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths_on_device", [False, True], ids=["host-lengths", "device-lengths"])
def test_compile_prefill_plans_from_either_planner_path(lengths_on_device):
    step = make_step("cuda", ratio=4, head_dim=512, seed=9, lengths_on_device=lengths_on_device)
    compiled_vs_eager(step, "aot_eager")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio", [4, 128])
def test_cuda_graph_capture_of_plan_compress_store(ratio):
    """A decode step (planner on device lengths, compress, store) captured once and replayed on the
    next step's inputs equals that step run eagerly."""
    dev = torch.device("cuda", torch.cuda.current_device())
    rpi, seq, _, r2t, f2s = (t.to(dev) for t in planner_inputs(11, 4, ratio, decode=True))
    next_seq = seq + 1
    next_seq[1] = ratio  # the next step compresses too (seq[0] = 2R is this step's boundary)
    static = make_step(dev, ratio=ratio, head_dim=512, decode=True, batch=4, seed=11)  # same planner inputs
    static_seq, static_x = seq.clone(), static.x.clone()

    def plan_for(lengths):
        return CompressorDecodePlan.generate(ratio, rpi, r2t, f2s, lengths, SWA_PAGE, RING[ratio])

    def step_fn():
        return pipeline(static.state, static_x, static.ape, plan_for(static_seq), static.weight, static.freq_cis,
                        static.out_loc, static.kvcache, ratio=ratio, head_dim=512, page_size=static.page_size,
                        use_fp4=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls (kernel loads) outside the capture
        step_fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step_fn()

    next_x = torch.randn_like(static_x)
    static_seq.copy_(next_seq)
    static_x.copy_(next_x)
    expected = static.fresh()  # state and cache as the replay finds them
    expected.x, expected.plan = next_x, plan_for(next_seq)
    static.plan = expected.plan
    static_out.fill_(float("nan"))
    graph.replay()
    out_expected = run(expected)
    assert_same_result(static, static_out, expected, out_expected)
    assert torch.isfinite(static_out).all()
