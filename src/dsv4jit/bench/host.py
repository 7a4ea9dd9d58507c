"""Host time per eager call of every public op and of a whole layer step: what an eager forward step
pays on the CPU when the host, not the GPU, is the slower side.

    python -m dsv4jit.bench.host [--json] [--only TEXT] [--against MODULE]

Method: the GPU is kept busy by a long sleep kernel, then N calls are enqueued and timed on the host
(the GPU work of a call never enters its figure); the median of several such batches. The floor is a
bare tvm-ffi call of an (almost) empty kernel, timed again beside every case. ``--against MODULE``
times another implementation of the same API (same names and signatures; an op it lacks is timed as
the two calls it replaces) on identical inputs, side by side: the batches of a row take turns.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from collections.abc import Callable

import torch

from .. import runtime
from . import report, timing

CALLS = 100      # calls per timed batch (a few hundred launches queued behind the sleep at most)
BATCHES = 15     # batches; the median is reported
SLEEP_CYCLES = 60_000_000  # about 30 ms of GPU time: longer than a batch of the slowest call
SPS = 256        # swa_page_size of the pool
PAGE = {4: 64, 128: 2}


def host_times_us(fns: list[Callable[[], object]], calls: int = CALLS, batches: int = BATCHES) -> list[float]:
    """Median over batches of the host time per call of each of `fns`, `calls` calls enqueued behind a
    sleeping GPU. Their batches take turns, so a host that speeds up or slows down during the run
    (clocks, other processes) moves every figure of a row alike."""
    for fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    per_call: list[list[float]] = [[] for _ in fns]
    collecting = gc.isenabled()
    gc.disable()  # a collection inside a batch is no call's cost (as timeit does)
    try:
        for _ in range(batches):
            for fn, times in zip(fns, per_call):
                torch.cuda._sleep(SLEEP_CYCLES)
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - start) / calls * 1e6)
                torch.cuda.synchronize()
    finally:
        if collecting:
            gc.enable()
    return [statistics.median(times) for times in per_call]


class Inputs:
    """One layer's operands for `api` (identity-mapped pool, fixed seeds: both APIs get equal tensors); a
    prefill extends requests of `prefix` tokens (a chunked prefill) when it is not 0."""

    def __init__(self, api, ratio: int, hd: int, batch: int, tokens: int, decode: bool, fmt: str, plan=None,
                 prefix: int = 0):
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(ratio * 1000 + hd + batch)
        ring = 8 if ratio == 4 else 128
        ctx = -(-(prefix + tokens + 1) // SPS) * SPS
        r2t = torch.arange(batch * ctx, dtype=torch.int32, device=dev).view(batch, ctx)
        f2s = torch.arange(batch * ctx + 1, dtype=torch.int64, device=dev)
        rid = torch.arange(batch, dtype=torch.int64, device=dev)
        width = hd * (4 if ratio == 4 else 2)
        rows = (batch * ctx // SPS) * ring if ratio == 4 else batch * ring
        num_q = batch if decode else batch * tokens
        self.state = torch.randn(-(-rows // ratio), ratio, width, device=dev, generator=gen)
        self.x = torch.randn(num_q, width, device=dev, generator=gen)
        self.ape = torch.randn(8 if ratio == 4 else 128, hd, device=dev, generator=gen)
        if plan is not None:  # another compressor's of the same layer
            self.plan = plan
        elif decode:
            seq = torch.full((batch,), tokens, dtype=torch.int64, device=dev)
            self.plan = api.CompressorDecodePlan.generate(ratio, rid, r2t, f2s, seq, SPS, ring)
        else:
            lens = torch.full((batch,), tokens, dtype=torch.int64)
            self.plan = api.CompressorPrefillPlan.generate(ratio, rid, lens + prefix, lens, r2t, f2s, SPS, ring, num_q)
        self.kv = torch.randn(self.plan[1].shape[0], hd, device=dev, generator=gen)
        page = PAGE[ratio]
        token_bytes = {"v4": 584, "idx-fp8": 132, "idx-fp4": 68}[fmt]
        page_bytes = -(-token_bytes * page // 576) * 576 if fmt == "v4" else token_bytes * page
        angles = torch.rand(prefix + tokens + 1, 32, device=dev, generator=gen)
        self.store = dict(norm_weight=torch.randn(hd, device=dev, generator=gen), norm_eps=1e-6,
                          freq_cis=torch.polar(torch.ones_like(angles), angles),
                          out_loc=torch.randperm(2 * num_q, device=dev)[:num_q],
                          kvcache=torch.zeros(-(-(2 * num_q) // page) + 1, page_bytes, dtype=torch.uint8, device=dev),
                          page_size=page, use_fp4=fmt == "idx-fp4")
        self.op = dict(head_dim=hd, compress_ratio=ratio)
        self.api = api

    def compress(self):
        return self.api.compress_forward(self.state, self.x, self.ape, self.plan, out=self.kv, **self.op)

    def store_rows(self):
        return self.api.compress_norm_rope_store(self.kv, self.plan, **self.store)

    def two_step(self):
        self.compress()
        self.store_rows()

    def fused(self):
        if not hasattr(self.api, "compress_and_store"):
            return self.two_step()
        return self.api.compress_and_store(self.state, self.x, self.ape, self.plan, **self.op, **self.store)


class C4Layer:
    """A c4 layer: the core (hd 512, V4 cache) and the indexer (hd 128, fp4 cache) on one plan."""

    def __init__(self, api, batch: int, tokens: int, decode: bool, prefix: int = 0):
        self.api = api
        self.core = Inputs(api, 4, 512, batch, tokens, decode, "v4", prefix=prefix)
        self.indexer = Inputs(api, 4, 128, batch, tokens, decode, "idx-fp4", plan=self.core.plan, prefix=prefix)

    def step(self):
        if not hasattr(self.api, "compress_and_store_c4_layer"):  # two steps per compressor
            self.core.two_step()
            return self.indexer.two_step()
        c, i = self.core, self.indexer
        return self.api.compress_and_store_c4_layer(
            c.state, c.x, c.ape, i.state, i.x, i.ape, c.plan, norm_weight=c.store["norm_weight"],
            indexer_norm_weight=i.store["norm_weight"], norm_eps=1e-6, freq_cis=c.store["freq_cis"],
            out_loc=c.store["out_loc"], kvcache=c.store["kvcache"], page_size=64, indexer_kvcache=i.store["kvcache"],
            indexer_out_loc=i.store["out_loc"], use_fp4=True)


class Speculative:
    """A verify batch of online c128 (head_dim 512, fp32 state) and its draft banks."""

    def __init__(self, api, batch: int = 32, verify: int = 4):
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(batch + verify)
        self.api, self.batch, self.verify = api, batch, verify
        self.x = torch.randn(batch * verify, 1024, device=dev, generator=gen)
        self.ape = torch.randn(128, 512, device=dev, generator=gen)
        self.state = torch.randn((verify + 1) * batch, 1536, device=dev, generator=gen).abs()
        self.seq = torch.randint(1, 4096, (batch,), device=dev, generator=gen)
        self.rid = torch.arange(batch, device=dev)
        self.r2t = torch.zeros(batch, 1, dtype=torch.int32, device=dev)
        self.pending = torch.full((batch,), -1, dtype=torch.int64, device=dev)

    def write_prefix(self):
        self.api.online_c128_mtp_write_prefix_states(self.x, self.seq, self.rid, self.r2t, self.ape, self.state,
                                                     self.batch, self.verify, self.batch, head_dim=512)

    def mark(self):
        self.api.online_c128_mtp_mark_pending(self.seq, self.rid, self.pending, self.batch, self.batch, head_dim=512,
                                              state_dtype=torch.float32)

    def commit(self):
        self.api.online_c128_mtp_commit_pending(self.seq + 2, self.rid, self.r2t, self.pending, self.state, self.batch,
                                                self.verify, self.batch, self.batch, head_dim=512)


def cases(api) -> dict[str, Callable[[], object]]:
    """Case name -> a call of `api` on fresh operands."""
    c4 = Inputs(api, 4, 512, 256, 1024, True, "v4")
    c128 = Inputs(api, 128, 512, 256, 1024, True, "v4")
    c4_prefill = Inputs(api, 4, 512, 1, 8192, False, "v4")
    idx_prefill = Inputs(api, 4, 128, 1, 8192, False, "idx-fp4")
    idx_chunk = Inputs(api, 4, 128, 1, 8192, False, "idx-fp4", prefix=8192)  # reads the state ring: two launches
    dev = torch.device("cuda")
    rid = torch.arange(256, dtype=torch.int64, device=dev)
    r2t = torch.arange(256 * 1280, dtype=torch.int32, device=dev).view(256, 1280)
    f2s = torch.arange(256 * 1280 + 1, dtype=torch.int64, device=dev)
    seq = torch.full((256,), 1024, dtype=torch.int64, device=dev)
    online_seq = torch.randint(1, 4096, (64,), device=dev)
    online_plan = api.CompressorDecodePlan.generate_online(online_seq, rid[:64], r2t[:64])
    online_state = torch.randn(64, 1, 1536, device=dev).abs()
    online_x = torch.randn(64, 1024, device=dev)
    online_out = torch.empty(64, 512, device=dev)
    calls = {
        "CompressorDecodePlan.generate c4 B=256": lambda: api.CompressorDecodePlan.generate(4, rid, r2t, f2s, seq, SPS,
                                                                                            8),
        "compress_forward decode c4 B=256": c4.compress,
        "compress_forward decode c128 B=256": c128.compress,
        "compress_forward prefill c4 1x8192": c4_prefill.compress,
        "compress_forward online decode B=64": lambda: api.compress_forward(
            online_state, online_x, c128.ape, online_plan, head_dim=512, compress_ratio=128, out=online_out,
            is_online=True),
        "compress_norm_rope_store decode v4 N=256": c4.store_rows,
        "compress_norm_rope_store prefill idx-fp4 N=2048": idx_prefill.store_rows,
        "layer step c4 decode, two calls": c4.two_step,
        "layer step c128 decode, two calls": c128.two_step,
        "layer step idx-fp4 prefill, two calls": idx_prefill.two_step,
        "compress_and_store c4 decode": c4.fused,
        "compress_and_store c128 decode": c128.fused,
        "compress_and_store idx-fp4 prefill": idx_prefill.fused,
        "compress_and_store idx-fp4 prefill after a prefix of 8192": idx_chunk.fused,
        "c4 layer decode B=256 (compress_and_store_c4_layer)": C4Layer(api, 256, 1024, True).step,
        "c4 layer prefill 1x8192 (compress_and_store_c4_layer)": C4Layer(api, 1, 8192, False).step,
        "c4 layer prefill 1x8192 after a prefix of 8192": C4Layer(api, 1, 8192, False, prefix=8192).step,
    }
    if hasattr(api, "online_c128_mtp_write_prefix_states"):
        spec = Speculative(api)
        calls.update({"online_c128_mtp_write_prefix_states B=32 V=4": spec.write_prefix,
                      "online_c128_mtp_mark_pending B=32": spec.mark,
                      "online_c128_mtp_commit_pending B=32 V=4": spec.commit})
    return calls


def floor_case() -> tuple[str, Callable[[], object]]:
    """A bare tvm-ffi call of the selftest kernel (two tensors, one launch): the least an op can cost."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1, device=dev)
    out = torch.empty_like(x)
    affine = runtime.function("selftest", "affine", dev, dtype="fp32")
    return "floor: bare tvm-ffi call + launch (selftest.affine)", lambda: affine(x, out, 1.0, 0.0)


def run(only: str = "", against: str | None = None) -> list[timing.Row]:
    import dsv4jit

    apis = {"dsv4jit": dsv4jit}
    if against:
        apis[against] = importlib.import_module(against)
    per_api = {name: cases(api) for name, api in apis.items()}
    floor_name, floor = floor_case()
    rows = [timing.Row.best_of("host", floor_name, {"host": host_times_us([floor])[0]}, ("host",))]
    for case in per_api["dsv4jit"]:
        if only not in case:
            continue
        # the floor again beside each case: "× floor" compares figures of one stretch of the run
        other = [per_api[against][case]] if against and case in per_api[against] else []
        floor_us, ours, *theirs = host_times_us([floor, per_api["dsv4jit"][case]] + other)
        times = {"host": ours}
        row = timing.Row.best_of("host", case, times, ("host",))
        row.ratios["× floor"] = ours / floor_us
        if theirs:  # > 1: dsv4jit spends less host time
            times[f"host {against}"] = theirs[0]
            row.times = dict(times)
            row.ratios[f"{against} / dsv4jit"] = theirs[0] / ours
        rows.append(row)
    return rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv, against=True)


if __name__ == "__main__":
    main()
