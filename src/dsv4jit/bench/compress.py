"""compress_forward throughput: µs (L2-cold eager and graph, and warm), bytes moved, GB/s and % of
the measured copy bandwidth.

    python -m dsv4jit.bench.compress [--json] [--only TEXT] [--against MODULE]

``--against MODULE`` times the same call of another implementation of the API (its own planner's
plans, the same tensors) right after ours; "MODULE / dsv4jit" > 1 means dsv4jit is faster.

Bytes count what the op must move at least: every input element it uses read once (window slots
from the ragged input or the state ring, tokens stored into the ring), every output element
written once (pooled rows, ring rows), plus plans and ape.
"""

from __future__ import annotations

import importlib

import torch

from .. import plan_layout
from ..ops import compress_forward
from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from . import report, timing

SWA_PAGE = 256


def _pool(batch: int, max_ctx: int, device):
    """Page-aligned SWA mapping: request r's position q lives in SWA slot (r·pages + q/256)·256 + q%256."""
    pages = (max_ctx + SWA_PAGE - 1) // SWA_PAGE
    req_to_token = torch.arange(batch * pages * SWA_PAGE, dtype=torch.int32, device=device).reshape(batch, -1)
    full_to_state = torch.arange(batch * pages * SWA_PAGE + 1, dtype=torch.int64, device=device)
    full_to_state[-1] = -1
    return req_to_token, full_to_state, batch * pages


class Case:
    def __init__(self, name, ratio, hd, seq, ext, decode, state_dtype=torch.float32, dtype=torch.float32,
                 dev=torch.device("cuda")):
        self.name, self.ratio, self.hd = name, ratio, hd
        batch = len(seq)
        r2t, f2s, swa_pages = _pool(batch, max(seq) + 8, dev)
        rpi = torch.arange(batch, dtype=torch.int64, device=dev)
        ring = 8 if ratio == 4 else 128
        state_rows = swa_pages * ring if ratio == 4 else batch * ring
        last_dim = (4 if ratio == 4 else 2) * hd
        self.state = torch.randn(state_rows // ratio, ratio, last_dim, device=dev).to(state_dtype)
        seq_t = torch.tensor(seq, dtype=torch.int64, device=dev)
        tokens = batch if decode else sum(ext)
        self._plan_args = ((ratio, rpi, r2t, f2s, seq_t, SWA_PAGE, ring) if decode else
                           (ratio, rpi, seq_t.cpu(), torch.tensor(ext, dtype=torch.int64), r2t, f2s, SWA_PAGE, ring,
                            tokens))
        self.decode = decode
        self.plan = self.plan_of()
        self.input = (2 * torch.randn(tokens, last_dim, device=dev)).to(dtype)
        self.ape = torch.randn(8 if ratio == 4 else 128, hd, device=dev).to(dtype)
        self.out = torch.empty(self.plan.plan_rows.shape[0], hd, device=dev, dtype=dtype)
        self.bytes = self._bytes(decode, state_dtype.itemsize, dtype.itemsize)

    def _bytes(self, decode, state_b, in_b) -> int:
        hd, window = self.hd, 8 if self.ratio == 4 else 128
        row_elems = (4 if self.ratio == 4 else 2) * hd
        ape = window * hd * in_b
        if decode:
            rows = plan_layout.decode_decode_plan(self.plan.plan_d)
            boundary = rows.seq_len % self.ratio == 0
            per_request = row_elems * (in_b + state_b) + hd * in_b + 16
            return int(len(rows.seq_len) * per_request + int(boundary.sum()) * (window - 1) * 2 * hd * state_b + ape)
        c, w = self.plan.rows()
        valid = c.valid
        buffered = c.buffer_len[valid].sum().item()
        slots = int(valid.sum()) * window
        masked = int(((c.seq_len == 4) & valid).sum()) * 4 if self.ratio == 4 else 0
        pooled = 2 * hd * (buffered * state_b + (slots - buffered - masked) * in_b)
        writes = int(w.valid.sum()) * row_elems * (in_b + state_b)
        return int(pooled + writes + int(valid.sum()) * hd * in_b + 16 * len(valid) + 8 * len(w.valid) + ape)

    def plan_of(self, api=None):
        """This case's plan from the planner of `api` (a module with dsv4jit's API; default dsv4jit)."""
        planner = CompressorDecodePlan if self.decode else CompressorPrefillPlan
        return (planner if api is None else getattr(api, planner.__name__)).generate(*self._plan_args)

    def __call__(self):
        compress_forward(self.state, self.input, self.ape, self.plan, head_dim=self.hd, compress_ratio=self.ratio,
                         out=self.out)

    def through(self, api):
        """The same call through `api`, with its own planner's plan (its rows, so its output, may be
        more than ours: a planner may keep rows that pool nothing)."""
        plan = self.plan_of(api)
        out = self.out.new_empty(plan[1].shape[0], self.hd)
        return lambda: api.compress_forward(self.state, self.input, self.ape, plan, head_dim=self.hd,
                                            compress_ratio=self.ratio, out=out)


def cases() -> list[tuple]:
    """(name, ratio, head_dim, seq_lens, extend_lens or None for decode, state dtype)."""
    fp32, bf16 = torch.float32, torch.bfloat16
    c = [
        ("prefill c4 hd512 1x8192", 4, 512, [8192], [8192], fp32),
        ("prefill c4 hd512 16x512", 4, 512, [512 + 37 * i for i in range(16)], [512] * 16, fp32),
        ("prefill c4 hd512 1x32768", 4, 512, [32768], [32768], fp32),
        ("prefill c4 hd128 1x8192", 4, 128, [8192], [8192], fp32),
        ("prefill c128 hd512 1x8192", 128, 512, [8192], [8192], fp32),
        ("prefill c128 hd512 1x32768", 128, 512, [32768], [32768], fp32),
        ("prefill c4 hd512 1x8192 bf16-state", 4, 512, [8192], [8192], bf16),
    ]
    c += [(f"decode c4 hd512 B={b} boundary", 4, 512, [400 + 4 * i for i in range(b)], None, fp32)
          for b in (1, 64, 256, 1024)]
    c += [(f"decode c128 hd512 B={b} boundary", 128, 512, [512 + 128 * (i % 8) for i in range(b)], None, fp32)
          for b in (1, 16, 128, 256)]
    c.append(("decode c4 hd512 B=256 off-boundary", 4, 512, [401 + 4 * i for i in range(256)], None, fp32))
    c.append(("decode c128 hd512 B=256 off-boundary", 128, 512, [513 + 128 * (i % 8) for i in range(256)], None, fp32))
    return c


def run(only: str = "", against: str | None = None) -> list[timing.Row]:
    other = importlib.import_module(against) if against else None
    bandwidth = timing.Bandwidth("compress")
    for name, ratio, hd, seq, ext, state_dtype in cases():
        if only in name:
            case = Case(name, ratio, hd, seq, ext, ext is None, state_dtype)
            bandwidth.measure(case.name, case.bytes, case, {against: case.through(other)} if other else None)
    return bandwidth.rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv, against=True)


if __name__ == "__main__":
    main()
