"""Loader and launch helper on a real GPU: current stream, PDL launches, graph capture (GPU tests)."""

from __future__ import annotations

import pytest
import torch

from dsv4jit import runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _affine(pdl: bool, dtype: str = "fp32"):
    return runtime.function("selftest", "affine", torch.device("cuda", torch.cuda.current_device()), dtype=dtype,
                            pdl=pdl)


@pytest.mark.parametrize("pdl", [False, True])
def test_runs_on_torchs_current_stream(pdl):
    """The kernel must run after work queued on the current (side) stream, not on another stream."""
    fn = _affine(pdl)
    x = torch.zeros(1 << 20, device="cuda")
    out = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps `side` busy, so a launch on any other stream runs first
        x.fill_(3.0)
        fn(x, out, 2.0, 1.0)
    side.synchronize()
    assert torch.all(out == 7.0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pdl_chain_and_graph_capture(dtype):
    """Back-to-back PDL launches (each waits for its producer) give exact results, eager and in a graph."""
    fn = _affine(True, dtype)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    x = torch.randint(-8, 8, (1 << 22,), device="cuda").to(torch_dtype)
    bufs = [torch.empty_like(x) for _ in range(8)]

    def chain():
        src = x
        for b in bufs:
            fn(src, b, 1.0, 1.0)
            src = b

    chain()
    torch.cuda.synchronize()
    assert torch.equal(bufs[-1], x + 8)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        chain()
    for b in bufs:
        b.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bufs[-1], x + 8)


def test_argument_errors_are_python_exceptions():
    fn = _affine(False)
    x = torch.randn(16, device="cuda")
    with pytest.raises(TypeError, match="argument 'x': must be a CUDA tensor"):
        fn(x.cpu(), x, 1.0, 0.0)
    with pytest.raises(TypeError, match="argument 'out': dtype must be float32, got bfloat16"):
        fn(x, x.bfloat16(), 1.0, 0.0)
    with pytest.raises(ValueError, match=r"dim 0 \('n'\) must be 16 \(as in 'x'\), got 8"):
        fn(x, x[:8].clone(), 1.0, 0.0)
