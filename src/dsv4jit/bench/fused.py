"""compress_and_store (fused) against compress_forward + compress_norm_rope_store (two-step), for the
ring compressors and the online c128 one.

    python -m dsv4jit.bench.fused [--json] [--only TEXT]

Both paths run on the same state pool, plans and inputs; times are medians per call, L2-cold (eager
and graph) and warm (bench/timing.py). Bytes are what the fused op must move (compress_forward's
bytes without the pooled rows, plus the cache rows stored), so its GB/s compares with the copy
bandwidth; the two-step path additionally writes and reads back the pooled fp32 rows.
"""

from __future__ import annotations

import random

import torch

from .. import plan_layout
from ..geometry import page_bytes
from ..ops import compress_and_store, compress_forward, compress_norm_rope_store
from . import compress as bench_compress
from . import online as bench_online
from . import report, timing

PAGE_SIZE = {4: 64, 128: 2}
STORED_BYTES = {"v4_fp8": 584, "v4_bf16": 1024, "indexer_fp8": 132, "indexer_fp4": 68}  # per stored row


class Case:
    """A compress case (bench.compress, or bench.online for the online c128 compressor) plus the store
    operands of one format."""

    def __init__(self, name, ratio, fmt, seq, ext, online=False):
        hd = 512 if fmt.startswith("v4") else 128
        decode = ext is None
        self.name, self.fmt = name, fmt
        self.c = (bench_online.OnlineCase(seq, ext, decode) if online
                  else bench_compress.Case(name, ratio, hd, seq, ext, decode))
        self.op = dict(head_dim=hd, compress_ratio=ratio, is_online=online)
        dev = self.c.state.device
        rows = self.c.plan.plan_rows.shape[0]
        tokens = self.c.input.shape[0]
        page_size = PAGE_SIZE[ratio]
        pages = (max(rows, tokens) + page_size - 1) // page_size + 1
        self.kvcache = torch.zeros(pages, page_bytes(fmt, page_size), dtype=torch.uint8, device=dev)
        locs = torch.randperm(pages * page_size, device=dev)[:rows if decode else tokens]
        angles = torch.rand(max(seq) + 1, 32, device=dev) * 6.283
        self.store = dict(norm_weight=1 + 0.1 * torch.randn(hd, device=dev), norm_eps=1e-6,
                          freq_cis=torch.polar(torch.ones_like(angles), angles), out_loc=locs,
                          kvcache=self.kvcache, page_size=page_size, use_fp4=fmt == "indexer_fp4",
                          bf16_store=fmt == "v4_bf16")
        pooled = self._pooled_rows(ratio)
        self.bytes = self.c.bytes - pooled * hd * 4 + pooled * (STORED_BYTES[fmt] + 8)

    def _pooled_rows(self, ratio: int) -> int:
        plan = self.c.plan
        if plan.is_decode:
            return int((plan_layout.decode_decode_plan(plan.plan_d).seq_len % ratio == 0).sum())
        return int(plan.rows()[0].valid.sum())

    def two_step(self):
        c = self.c
        kv = compress_forward(c.state, c.input, c.ape, c.plan, out=c.out, **self.op)
        compress_norm_rope_store(kv, c.plan, **self.store)

    def fused(self):
        c = self.c
        compress_and_store(c.state, c.input, c.ape, c.plan, **self.op, **self.store)


def cases() -> list[tuple]:
    """(name, ratio, format, seq_lens, extend_lens or None for decode, online). Decode batches: every
    request at a boundary, every other one, and for ring c128 random lengths (a real decode step:
    about one request in 128 at a boundary) and none."""
    out = []
    for ratio, fmt, online in ((4, "v4_fp8", False), (4, "indexer_fp4", False), (128, "v4_fp8", False),
                               (128, "v4_fp8", True)):
        hd = 512 if fmt == "v4_fp8" else 128
        tag = f"{'online ' if online else ''}c{ratio} hd{hd} {fmt}"
        for b in (1, 16, 64, 256):
            base = 512 if ratio == 128 else 400
            out.append((f"decode {tag} B={b} boundary", ratio, fmt, [base + ratio * (i % 8) for i in range(b)], None,
                        online))
            out.append((f"decode {tag} B={b} mixed", ratio, fmt, [base + ratio * (i % 8) + i % 2 for i in range(b)],
                        None, online))
        if ratio == 128 and not online:
            for b in (1, 32, 128, 1024):
                rng = random.Random(b)
                out.append((f"decode {tag} B={b} random", ratio, fmt, [rng.randint(512, 16383) for _ in range(b)],
                            None, online))
                out.append((f"decode {tag} B={b} none", ratio, fmt, [513 + 128 * (i % 8) + i % 5 for i in range(b)],
                            None, online))
        for n in (8192, 32768):
            out.append((f"prefill {tag} 1x{n}", ratio, fmt, [n], [n], online))
    return out


def run(only: str = "") -> list[timing.Row]:
    """Headline: the fused op's faster L2-cold time; ``speedup`` is the two-step path's faster cold time
    over it, ``speedup_warm`` the same of the warm times."""
    bandwidth = timing.Bandwidth("fused")
    for name, ratio, fmt, seq, ext, online in cases():
        if only not in name:
            continue
        case = Case(name, ratio, fmt, seq, ext, online)
        times = {**timing.cold_and_warm(case.two_step, "two_step_"), **timing.cold_and_warm(case.fused)}
        row = bandwidth.add(name, case.bytes, times)
        two_step = min(times["two_step_eager"], times["two_step_graph"])
        row.ratios.update(speedup=two_step / row.us, speedup_warm=times["two_step_warm"] / times["warm"])
    return bandwidth.rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
