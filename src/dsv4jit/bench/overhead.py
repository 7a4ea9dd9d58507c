"""Host-side cost of each layer of a call (CPU µs per call, medians; the GPU runs behind).

    python -m dsv4jit.bench.overhead [--json] [--only TEXT]

Separates torch allocation, the tvm-ffi call with its argument checks, the kernel launch, and the
Python wrappers, so the cost of an op's eager call can be attributed.
"""

from __future__ import annotations

import torch

from .. import runtime
from ..ops import compress_forward, compress_norm_rope_store
from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from . import report, timing


def run(only: str = "") -> list[timing.Row]:
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []

    def add(name, fn):
        if only in name:
            rows.append(timing.Row.best_of("overhead", name, {"host": timing.host_us(fn)}, ("host",)))

    add("torch.empty((256, 16), uint8)", lambda: torch.empty((256, 16), dtype=torch.uint8, device=dev))
    x1 = torch.randn(1, device=dev)
    o1 = torch.empty_like(x1)
    affine = runtime.function("selftest", "affine", dev, dtype="fp32")
    add("selftest.affine (2 tensors, 1 launch)", lambda: affine(x1, o1, 1.0, 0.0))
    add("runtime.function lookup", lambda: runtime.function("selftest", "affine", dev, dtype="fp32"))

    batch = 256
    r2t = torch.arange(batch * 4096, dtype=torch.int32, device=dev).reshape(batch, 4096)
    f2s = torch.arange(batch * 4096 + 1, dtype=torch.int64, device=dev)
    rpi = torch.arange(batch, dtype=torch.int64, device=dev)
    seq = torch.full((batch,), 404, dtype=torch.int64, device=dev)
    add("CompressorDecodePlan.generate B=256", lambda: CompressorDecodePlan.generate(4, rpi, r2t, f2s, seq, 256, 8))
    rpi1 = rpi[:1]
    seq_cpu, ext_cpu = torch.tensor([8192]), torch.tensor([8192])
    big = torch.arange(8192 + 256, dtype=torch.int32, device=dev)[None]
    big_f2s = torch.arange(8192 + 257, dtype=torch.int64, device=dev)
    add("CompressorPrefillPlan.generate cpu-lengths 1x8192",
        lambda: CompressorPrefillPlan.generate(4, rpi1, seq_cpu, ext_cpu, big, big_f2s, 256, 8, 8192))
    host_lengths = runtime.function("plan", "prefill_host_lengths", dev)
    plan_c = torch.empty(2049, 16, dtype=torch.uint8, device=dev)
    plan_w = torch.empty(8192, 8, dtype=torch.uint8, device=dev)
    add("its ffi call alone: plan.prefill_host_lengths",
        lambda: host_lengths(rpi1, big, big_f2s, seq_cpu, ext_cpu, plan_c, plan_w, None, 8192, 4, 256, 8, False, False,
                             False))
    plan = CompressorDecodePlan.generate(4, rpi1, r2t, f2s, seq[:1], 256, 8)
    state = torch.randn(8192, 4, 2048, device=dev)
    inp = torch.randn(1, 2048, device=dev)
    ape = torch.randn(8, 512, device=dev)
    out = torch.empty(1, 512, device=dev)
    add("compress_forward decode B=1 (out given)",
        lambda: compress_forward(state, inp, ape, plan, head_dim=512, compress_ratio=4, out=out))
    decode = runtime.function("compress_c4", "decode", dev, head_dim=512, state="fp32", input="fp32", output="fp32")
    add("its ffi call alone: compress_c4.decode", lambda: decode(state, inp, ape, plan.plan_d, out, None))

    kv = torch.randn(1, 512, device=dev)
    weight = torch.ones(512, device=dev)
    freq = torch.polar(torch.ones(4096, 32, device=dev), torch.rand(4096, 32, device=dev))
    cache = torch.zeros(4, 37440, dtype=torch.uint8, device=dev)
    loc = torch.zeros(1, dtype=torch.int64, device=dev)
    add("compress_norm_rope_store decode B=1",
        lambda: compress_norm_rope_store(kv, plan, norm_weight=weight, norm_eps=1e-6, freq_cis=freq, out_loc=loc,
                                         kvcache=cache, page_size=64))
    return rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
