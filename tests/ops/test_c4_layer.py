"""compress_and_store_c4_layer: a c4 layer's core (head_dim 512, V4 cache) and indexer (head_dim 128,
indexer cache) steps in one op, byte-identical to two compress_and_store calls.

Two copies of a layer (states and caches from the same random bytes) run the same steps: copy A
through compress_and_store for each compressor, copy B through the layer op. After every step the
states and caches must be equal bit for bit, and the steps must have stored rows. Bad arguments are
named as the layer op's (the indexer's with their ``indexer_`` names) and write nothing.
"""

from __future__ import annotations

import pytest
import torch

from dsv4jit import CompressorDecodePlan, CompressorPrefillPlan, compress_and_store, compress_and_store_c4_layer, runtime
from dsv4jit.geometry import page_bytes
from helpers.kernel_trace import dsv4jit_kernels

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])
SPS, RING, PAGE = 256, 8, 64
CTX = 1024


class Layer:
    """An identity-mapped paged pool of `batch` requests and one c4 layer's tensors, twice."""

    def __init__(self, device, batch, *, indexer_format="indexer_fp4", state_dtype=torch.float32,
                 in_dtype=torch.float32, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.batch, self.in_dtype = device, batch, in_dtype
        self.r2t = torch.arange(batch * CTX, dtype=torch.int32).view(batch, CTX).to(device)
        self.f2s = torch.arange(batch * CTX + 1, dtype=torch.int64).to(device)
        self.rid = torch.arange(batch, device=device)
        self.use_fp4 = indexer_format == "indexer_fp4"
        pages = batch * CTX // SPS * RING // 4
        self.a, self.b = {}, {}
        for prefix, hd, fmt in (("", 512, "v4_fp8"), ("indexer_", 128, indexer_format)):
            state = torch.randn(pages, 4, 4 * hd, generator=self.gen).to(state_dtype)
            cache = torch.randint(0, 256, (2 * batch * CTX // 4 // PAGE + 1, page_bytes(fmt, PAGE)), generator=self.gen,
                                  dtype=torch.uint8)
            self.a[prefix + "kv_score_buffer"], self.a[prefix + "kvcache"] = state.to(device), cache.to(device)
            self.b[prefix + "kv_score_buffer"], self.b[prefix + "kvcache"] = state.clone().to(device), cache.to(device)
            self.a[prefix + "ape"] = torch.randn(8, hd, generator=self.gen).to(device)
            self.a[prefix + "norm_weight"] = (1 + 0.3 * torch.randn(hd, generator=self.gen)).to(device)
        angles = torch.rand(CTX, 32, generator=self.gen) * 6.283
        self.freq_cis = torch.polar(torch.ones_like(angles), angles).to(device)
        self.done = [0] * batch
        self.stored = 0

    def inputs(self, n: int) -> dict:
        return {prefix + "kv_score_input": (2 * torch.randn(n, 4 * hd, generator=self.gen)).to(self.in_dtype)
                .to(self.device) for prefix, hd in (("", 512), ("indexer_", 128))}

    def out_locs(self, n: int) -> dict:
        locs = torch.randperm(2 * self.batch * CTX // 4 - 1, generator=self.gen)[:2 * n] + 1
        return {"out_loc": locs[:n].to(self.device), "indexer_out_loc": locs[n:].to(self.device)}

    def step(self, plan, x: dict, locs: dict) -> None:
        before = {k: v.clone() for k, v in self.a.items() if k.endswith("kvcache")}
        for prefix, hd in (("", 512), ("indexer_", 128)):
            compress_and_store(self.a[prefix + "kv_score_buffer"], x[prefix + "kv_score_input"], self.a[prefix + "ape"],
                               plan, head_dim=hd, compress_ratio=4, norm_weight=self.a[prefix + "norm_weight"],
                               norm_eps=1e-6, freq_cis=self.freq_cis, out_loc=locs[prefix + "out_loc"],
                               kvcache=self.a[prefix + "kvcache"], page_size=PAGE, use_fp4=self.use_fp4 and bool(prefix))
        self.layer(self.b, plan, x, locs)
        for name in self.b:
            assert torch.equal(self.a[name], self.b[name]), name
        self.stored += all(not torch.equal(before[k], self.a[k]) for k in before)

    def layer(self, tensors, plan, x, locs, **change):
        args = dict(kv_score_buffer=tensors["kv_score_buffer"], kv_score_input=x["kv_score_input"], ape=self.a["ape"],
                    indexer_kv_score_buffer=tensors["indexer_kv_score_buffer"],
                    indexer_kv_score_input=x["indexer_kv_score_input"], indexer_ape=self.a["indexer_ape"], plan=plan,
                    norm_weight=self.a["norm_weight"], indexer_norm_weight=self.a["indexer_norm_weight"],
                    norm_eps=1e-6, freq_cis=self.freq_cis, kvcache=tensors["kvcache"],
                    indexer_kvcache=tensors["indexer_kvcache"], page_size=PAGE, use_fp4=self.use_fp4, **locs)
        args.update(change)
        compress_and_store_c4_layer(**args)

    def prefill(self, extends, gpu_lengths=False):
        seq = [d + e for d, e in zip(self.done, extends)]
        where = self.device if gpu_lengths else "cpu"
        n = sum(extends)
        plan = CompressorPrefillPlan.generate(4, self.rid, torch.tensor(seq, device=where),
                                              torch.tensor(extends, device=where), self.r2t, self.f2s, SPS, RING, n)
        self.step(plan, self.inputs(n), self.out_locs(n))
        self.done = seq

    def decode(self):
        self.done = [d + 1 for d in self.done]
        plan = CompressorDecodePlan.generate(4, self.rid, self.r2t, self.f2s, torch.tensor(self.done, device=self.device),
                                             SPS, RING)
        self.step(plan, self.inputs(self.batch), self.out_locs(self.batch))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("indexer_format", ["indexer_fp4", "indexer_fp8"])
def test_layer_equals_two_calls(device, indexer_format):
    layer = Layer(device, 5, indexer_format=indexer_format, seed=1)
    layer.prefill([37, 4, 130, 1, 9])
    layer.prefill([3, 100, 2, 7, 1], gpu_lengths=device == "cuda")
    for _ in range(6):
        layer.decode()
    assert layer.stored >= 5


@pytest.mark.parametrize("device", [CUDA])
def test_layer_prefill_without_prefixes_is_one_launch(device):
    """A layer prefill in which no request has a prefix is one launch (both pool passes, then both write
    passes' blocks, in one grid); with prefixes, two. Both equal two compress_and_store calls."""
    layer = Layer(device, 2, seed=4)
    launched = []
    run = layer.layer

    def traced(tensors, *args, **kw):
        if tensors is not layer.b:
            return run(tensors, *args, **kw)
        launched.append(dsv4jit_kernels(lambda: run(tensors, *args, **kw)))

    layer.layer = traced
    layer.prefill([37, 130])
    layer.prefill([2, 6])  # both resume
    layer.decode()  # request 0 closes a window
    assert [len(names) for names in launched] == [1, 2, 1], launched
    assert "pair_write_kernel" in launched[1][1], launched
    assert layer.stored == 3


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_layer_bf16(device, dtypes):
    layer = Layer(device, 4, state_dtype=dtypes[0], in_dtype=dtypes[1], seed=2)
    layer.prefill([70, 9, 12, 33])
    for _ in range(5):
        layer.decode()
    assert layer.stored >= 4


@pytest.mark.parametrize("device", [CUDA])
def test_layer_decode_in_cuda_graph(device):
    layer = Layer(device, 8, seed=3)
    layer.prefill([63 + b for b in range(8)])
    seq = torch.tensor([d + 1 for d in layer.done], device=device)
    x, locs = layer.inputs(8), layer.out_locs(8)
    plan = CompressorDecodePlan.generate(4, layer.rid, layer.r2t, layer.f2s, seq, SPS, RING)
    layer.layer(layer.b, plan, x, locs)  # warm: loads the module
    fresh = {k: v.clone() for k, v in layer.b.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.layer(layer.b, plan, x, locs)
    for k, v in fresh.items():
        layer.b[k].copy_(v)
    graph.replay()
    expect = {k: v.clone() for k, v in fresh.items()}
    layer.layer(expect, plan, x, locs)
    torch.cuda.synchronize()
    for k in expect:
        assert torch.equal(layer.b[k], expect[k]), k


BAD = [  # (change of arguments, error, the argument it names)
    (lambda L, x: {"indexer_kv_score_buffer": L.b["indexer_kv_score_buffer"][..., :256]}, ValueError,
     "indexer_kv_score_buffer"),
    (lambda L, x: {"kv_score_input": x["kv_score_input"][:, :1024]}, ValueError, "kv_score_input"),
    (lambda L, x: {"indexer_out_loc": torch.zeros(3, device=L.device)}, TypeError, "indexer_out_loc"),
    (lambda L, x: {"indexer_kvcache": L.b["indexer_kvcache"][:, :64]}, ValueError, "indexer_kvcache"),
    (lambda L, x: {"indexer_norm_weight": L.a["norm_weight"]}, ValueError, "indexer_norm_weight"),
    (lambda L, x: {"freq_cis": L.freq_cis[:, :16]}, ValueError, "freq_cis"),
    (lambda L, x: {"page_size": 48}, ValueError, "page_size"),
    (lambda L, x: {"indexer_page_size": 64.0}, TypeError, "indexer_page_size"),
    (lambda L, x: {"norm_eps": -1.0}, ValueError, "norm_eps"),
    (lambda L, x: {"indexer_ape": "ape"}, TypeError, "indexer_ape"),
    # the fast path of a signature seen before converts float ape and weights only
    (lambda L, x: {"ape": L.a["ape"].to(torch.int32)}, TypeError, "ape"),
]
# dtypes the kernels refuse (the torch references compute in any)
BAD_CUDA = [
    (lambda L, x: {"indexer_norm_weight": L.a["indexer_norm_weight"].to(torch.int64)}, TypeError,
     "indexer_norm_weight"),
    (lambda L, x: {"freq_cis": torch.view_as_real(L.freq_cis).flatten(-2).double()}, TypeError, "freq_cis"),
]
CASES = ([pytest.param("cpu", case, id=f"cpu-{i}") for i, case in enumerate(BAD)]
         + [pytest.param("cuda", case, id=f"cuda-{i}", marks=CUDA.marks) for i, case in enumerate(BAD + BAD_CUDA)])


@pytest.mark.parametrize("device, case", CASES)
def test_layer_bad_arguments(device, case):
    layer = Layer(device, 3, seed=4)
    layer.done = [20, 30, 40]
    seq = torch.tensor([21, 31, 41], device=device)
    plan = CompressorDecodePlan.generate(4, layer.rid, layer.r2t, layer.f2s, seq, SPS, RING)
    x, locs = layer.inputs(3), layer.out_locs(3)
    layer.layer(layer.b, plan, x, locs)  # a good call first: on CUDA the bad one meets the fast path
    change, error, name = case
    before = {k: v.clone() for k, v in layer.b.items()}
    with pytest.raises(error, match=rf"^dsv4jit\.compress_and_store_c4_layer: argument '{name}'"):
        layer.layer(layer.b, plan, x, locs, **change(layer, x))
    for k, v in before.items():
        assert torch.equal(layer.b[k], v), k


def _with(value: float, name: str, index=None):
    """A change of `name` (a tensor of the layer's, or its inputs') to hold `value` at `index` (None: everywhere)."""
    def change(L, x):
        t = (x[name] if name in x else L.a[name] if name in L.a else L.freq_cis).clone()
        t[... if index is None else index] = value
        return {name: t}
    return change


NON_FINITE = [  # (change, the argument named, its index in the message)
    (_with(float("nan"), "indexer_kv_score_input", (2, 5)), "indexer_kv_score_input", r"\[2, 5\]"),
    (_with(float("inf"), "kv_score_input", (0, 1000)), "kv_score_input", r"\[0, 1000\]"),
    (_with(float("-inf"), "ape", (7, 3)), "ape", r"\[7, 3\]"),
    (_with(float("nan"), "indexer_norm_weight", 77), "indexer_norm_weight", r"\[77\]"),
    (_with(float("nan"), "freq_cis"), "freq_cis", r"\[\d+, 0\]"),
]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", NON_FINITE, ids=[c[1] for c in NON_FINITE])
def test_layer_non_finite_inputs_are_named(device, case):
    """On the CPU always, on the GPU in checked mode, before either step writes."""
    layer = Layer(device, 3, seed=4)
    layer.done = [23, 30, 39]  # requests 0 and 2 close a window: their rows are stored
    plan = CompressorDecodePlan.generate(4, layer.rid, layer.r2t, layer.f2s, torch.tensor([24, 31, 40], device=device),
                                         SPS, RING)
    x, locs = layer.inputs(3), layer.out_locs(3)
    change, name, index = case
    before = {k: v.clone() for k, v in layer.b.items()}
    runtime.set_checks(device == "cuda")
    try:
        with pytest.raises(ValueError, match=rf"^dsv4jit\.compress_and_store_c4_layer: argument '{name}': must hold "
                                             rf"finite values only \(no NaN or infinity\), got .* at {index}"):
            layer.layer(layer.b, plan, x, locs, **change(layer, x))
    finally:
        runtime.set_checks(None)
    for k, v in before.items():
        assert torch.equal(layer.b[k], v), k


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_plan_of_another_batch_is_named_as_the_plan(device):
    """A decode plan of 5 requests with the tensors of 3: the message used to name 'indexer_out_loc'."""
    five, three = Layer(device, 5, seed=5), Layer(device, 3, seed=4)
    plan = CompressorDecodePlan.generate(4, five.rid, five.r2t, five.f2s, torch.full((5,), 21, device=device), SPS,
                                         RING)
    with pytest.raises(ValueError, match=r"^dsv4jit\.compress_and_store_c4_layer: argument 'plan' and argument "
                                         r"'kv_score_input' are of different batches or steps: the plan is a decode "
                                         r"plan of 5 requests, 'kv_score_input' has 3 rows$"):
        three.layer(three.b, plan, three.inputs(3), three.out_locs(3))


def test_c128_plan_is_refused():
    layer = Layer("cpu", 2)
    plan = CompressorDecodePlan.generate(128, layer.rid, layer.r2t, layer.f2s, torch.tensor([5, 6]), SPS, 128)
    with pytest.raises(ValueError, match=r"argument 'plan' must be a c4 plan"):
        layer.layer(layer.b, plan, layer.inputs(2), layer.out_locs(2))
