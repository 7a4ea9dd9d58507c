"""compress_norm_rope_store throughput: µs (L2-cold eager and graph, and warm), bytes moved, GB/s, %
of copy bandwidth.

    python -m dsv4jit.bench.store [--json] [--only TEXT] [--against MODULE]

Formats: DeepSeek-V4's latent and indexer formats and the V4.1 layouts ``v41`` and ``v41_fp4``.
``--against MODULE`` times the same call of another implementation of the API (same plan, tensors and
cache) right after ours; "MODULE / dsv4jit" > 1 means dsv4jit is faster.

Bytes: each compressed row read once (plus its plan row, out_loc entry and rope-table row), each
stored token's cache bytes written once, the norm weight once.
"""

from __future__ import annotations

import importlib

import torch

from .. import plan_layout
from ..geometry import format_head_dim, format_options, page_bytes, written_bytes
from ..ops import compress_norm_rope_store
from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from . import report, timing


class Case:
    def __init__(self, fmt: str, rows: int, decode: bool, page_size: int = 64, ratio: int = 4,
                 dev=torch.device("cuda")):
        hd = format_head_dim(fmt)
        self.kv = torch.randn(rows, hd, device=dev)
        self.weight = torch.rand(hd, device=dev) + 0.5
        max_pos = 1 << 16
        angles = torch.rand(max_pos, 32, device=dev) * 6.28
        self.freq = torch.polar(torch.ones_like(angles), angles)
        seq_len = (torch.randint(1, max_pos // ratio, (rows,)) * ratio).to(torch.int64)
        pages = (rows + page_size - 1) // page_size + 1
        self.kvcache = torch.zeros(pages, page_bytes(fmt, page_size), dtype=torch.uint8, device=dev)
        locs = torch.randperm(pages * page_size)[:rows]
        if decode:
            zeros = torch.zeros(rows, dtype=torch.int64)
            plan_d = plan_layout.encode_decode_plan(seq_len, zeros, zeros, zeros).to(dev)
            self.plan = CompressorDecodePlan(ratio, plan_d)
            self.out_loc = locs.to(dev)
        else:  # one event per ratio tokens: ragged ids spread over a step of rows * ratio tokens
            ragged = torch.arange(rows, dtype=torch.int64) * ratio + ratio - 1
            zeros = torch.zeros(rows, dtype=torch.int64)
            plan_c = plan_layout.encode_compress_plan(seq_len, ragged, zeros, zeros - 1, zeros).to(dev)
            self.plan = CompressorPrefillPlan(ratio, plan_c, torch.empty(0, 8, dtype=torch.uint8, device=dev), None,
                                              rows * ratio)
            self.out_loc = torch.zeros(rows * ratio, dtype=torch.int64)
            self.out_loc[ragged] = locs
            self.out_loc = self.out_loc.to(dev)
        self.fmt, self.page_size = fmt, page_size
        self.bytes = rows * (hd * 4 + written_bytes(fmt) + 16 + 8 + 64 * 4) + hd * 4

    def __call__(self):
        self.through(None)()

    def through(self, api):
        """The call through `api` (a module with dsv4jit's API; None: dsv4jit) on this case's tensors."""
        store = compress_norm_rope_store if api is None else api.compress_norm_rope_store
        return lambda: store(self.kv, self.plan, norm_weight=self.weight, norm_eps=1e-6, freq_cis=self.freq,
                             out_loc=self.out_loc, kvcache=self.kvcache, page_size=self.page_size,
                             **format_options(self.fmt))


def run(only: str = "", against: str | None = None) -> list[timing.Row]:
    other = importlib.import_module(against) if against else None
    bandwidth = timing.Bandwidth("store")
    for fmt in ("v4_fp8", "indexer_fp8", "indexer_fp4", "v41", "v41_fp4"):
        for decode in (False, True):
            for n in (16, 256, 2048, 16384):
                name = f"{'decode' if decode else 'prefill'} {fmt} N={n}"
                if only in name:
                    case = Case(fmt, n, decode)
                    bandwidth.measure(name, case.bytes, case, {against: case.through(other)} if other else None)
    return bandwidth.rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv, against=True)


if __name__ == "__main__":
    main()
