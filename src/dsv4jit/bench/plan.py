"""Planner latency: host+device (wall) and kernel-only (events), medians in µs.

    python -m dsv4jit.bench.plan [--json] [--only TEXT]
"""

from __future__ import annotations

import json

import torch

from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from . import timing


def _pool(batch: int, max_ctx: int, device):
    """A paged pool: page-aligned SWA slots for every request's positions (c4 paged addressing)."""
    req_to_token = torch.arange(batch * max_ctx, dtype=torch.int32, device=device).reshape(batch, max_ctx)
    full_to_state = torch.arange(batch * max_ctx + 1, dtype=torch.int64, device=device)
    full_to_state[-1] = -1
    req_pool_indices = torch.randperm(batch, device=device).to(torch.int64)
    return req_pool_indices, req_to_token, full_to_state


def prefill_case(name, ratio, seq, ext, ring, on_gpu_lengths, use_cuda_graph=False) -> dict:
    dev = torch.device("cuda")
    batch, max_ctx = len(seq), max(seq) + 256
    rpi, r2t, f2s = _pool(batch, max_ctx, dev)
    lens_dev = dev if on_gpu_lengths else torch.device("cpu")
    seq_t = torch.tensor(seq, dtype=torch.int64, device=lens_dev)
    ext_t = torch.tensor(ext, dtype=torch.int64, device=lens_dev)
    num_q = sum(ext)

    def call():
        return CompressorPrefillPlan.generate(ratio, rpi, seq_t, ext_t, r2t, f2s, 256, ring, num_q,
                                              use_cuda_graph=use_cuda_graph)

    row = {"case": name, "wall_us": timing.wall_us(call), "host_us": timing.host_us(call)}
    if on_gpu_lengths:
        row["graph_us"] = timing.graph_us(call)
    return row


def decode_case(name, ratio, batch, ring) -> dict:
    dev = torch.device("cuda")
    rpi, r2t, f2s = _pool(batch, 4096, dev)
    seq_t = torch.randint(1, 4000, (batch,), dtype=torch.int64, device=dev)

    def call():
        return CompressorDecodePlan.generate(ratio, rpi, r2t, f2s, seq_t, 256, ring)

    return {"case": name, "wall_us": timing.wall_us(call), "host_us": timing.host_us(call),
            "graph_us": timing.graph_us(call)}


CASES = [
    ("prefill c4 cpu-lengths 1x8192", lambda name: prefill_case(name, 4, [8192], [8192], 8, False)),
    ("prefill c4 cpu-lengths 16x512", lambda name: prefill_case(name, 4, [512] * 16, [512] * 16, 8, False)),
    ("prefill c128 cpu-lengths 1x8192", lambda name: prefill_case(name, 128, [8192], [8192], 128, False)),
    ("prefill c4 gpu-lengths B=256 MTP E=4",
     lambda name: prefill_case(name, 4, [1000 + 7 * i for i in range(256)], [4] * 256, 16, True)),
    ("prefill c4 gpu-lengths B=64 ragged",
     lambda name: prefill_case(name, 4, [300 + 37 * i for i in range(64)], [1 + (13 * i) % 97 for i in range(64)], 8,
                               True)),
    ("decode c4 B=256", lambda name: decode_case(name, 4, 256, 8)),
]


def measure(only: str = "") -> list[dict]:
    rows = [make(name) for name, make in CASES if only in name]
    sync = timing.sync_overhead_us()
    for r in rows:
        r["wall_minus_sync_us"] = r["wall_us"] - sync
    return rows


def run(only: str = "") -> list[timing.Row]:
    """Headline: device time in a graph replay where the lengths are on the GPU, else wall − sync."""
    out = []
    for r in measure(only):
        times = {k[:-3]: v for k, v in r.items() if k.endswith("_us")}
        graph = "graph_us" in r
        out.append(timing.Row("plan", r["case"], r["graph_us"] if graph else r["wall_minus_sync_us"],
                              "graph" if graph else "wall_minus_sync", times=times))
    return out


def main(argv=None) -> None:
    args = timing.bench_args(__doc__, argv)
    rows = measure(args.only)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("wall: call until its GPU work is done (incl. one synchronize); wall-sync: minus an idle synchronize;")
    print("host: CPU time of the call (GPU runs behind); graph: device time per call in a CUDA graph replay")
    print(f"{'case':42s} {'wall':>8s} {'wall-sync':>10s} {'host':>8s} {'graph':>8s}  (µs, medians)")
    for r in rows:
        g = f"{r['graph_us']:8.2f}" if "graph_us" in r else f"{'-':>8s}"
        print(f"{r['case']:42s} {r['wall_us']:8.2f} {r['wall_minus_sync_us']:10.2f} {r['host_us']:8.2f} {g}")


if __name__ == "__main__":
    main()
