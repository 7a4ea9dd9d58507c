"""Planner latency, medians in µs: wall (the call until its GPU work is done, one synchronize
included; wall_minus_sync without an idle synchronize), host (the CPU's part; the GPU runs behind)
and, where the lengths are on the GPU, graph (device time of one call replayed from a CUDA graph).
wall and graph are L2-cold (bench/timing.py).

    python -m dsv4jit.bench.plan [--json] [--only TEXT]
"""

from __future__ import annotations

import torch

from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from . import report, timing


def _pool(batch: int, max_ctx: int, device):
    """A paged pool: page-aligned SWA slots for every request's positions (c4 paged addressing)."""
    req_to_token = torch.arange(batch * max_ctx, dtype=torch.int32, device=device).reshape(batch, max_ctx)
    full_to_state = torch.arange(batch * max_ctx + 1, dtype=torch.int64, device=device)
    full_to_state[-1] = -1
    req_pool_indices = torch.randperm(batch, device=device).to(torch.int64)
    return req_pool_indices, req_to_token, full_to_state


def prefill_case(ratio, seq, ext, ring, on_gpu_lengths, use_cuda_graph=False) -> dict[str, float]:
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

    times = {"wall": timing.wall_us(call), "host": timing.host_us(call)}
    if on_gpu_lengths:
        times["graph"] = timing.graph_us(call)
    return times


def decode_case(ratio, batch, ring) -> dict[str, float]:
    dev = torch.device("cuda")
    rpi, r2t, f2s = _pool(batch, 4096, dev)
    seq_t = torch.randint(1, 4000, (batch,), dtype=torch.int64, device=dev)

    def call():
        return CompressorDecodePlan.generate(ratio, rpi, r2t, f2s, seq_t, 256, ring)

    return {"wall": timing.wall_us(call), "host": timing.host_us(call), "graph": timing.graph_us(call)}


CASES = [
    ("prefill c4 cpu-lengths 1x8192", lambda: prefill_case(4, [8192], [8192], 8, False)),
    ("prefill c4 cpu-lengths 16x512", lambda: prefill_case(4, [512] * 16, [512] * 16, 8, False)),
    ("prefill c128 cpu-lengths 1x8192", lambda: prefill_case(128, [8192], [8192], 128, False)),
    ("prefill c4 gpu-lengths B=256 MTP E=4",
     lambda: prefill_case(4, [1000 + 7 * i for i in range(256)], [4] * 256, 16, True)),
    ("prefill c4 gpu-lengths B=64 ragged",
     lambda: prefill_case(4, [300 + 37 * i for i in range(64)], [1 + (13 * i) % 97 for i in range(64)], 8, True)),
    ("decode c4 B=256", lambda: decode_case(4, 256, 8)),
]


def run(only: str = "") -> list[timing.Row]:
    """Headline: graph where the lengths are on the GPU, else wall_minus_sync."""
    measured = {name: make() for name, make in CASES if only in name}
    sync = timing.sync_overhead_us()
    rows = []
    for name, times in measured.items():
        times["wall_minus_sync"] = times["wall"] - sync
        headline = ("graph",) if "graph" in times else ("wall_minus_sync",)
        rows.append(timing.Row.best_of("plan", name, times, headline))
    return rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
