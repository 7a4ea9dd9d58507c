"""Online c128 compress_forward (contract §5) vs the plain c128 kernels on the same histories.

    python -m dsv4jit.bench.online [--json] [--only TEXT]

Bytes count what the op must move at least. Online decode: the plan row, the input row (2·hd fp32),
the ape row, the stored state (3·hd, unless the token opens a chunk), then the new state (or, at a
boundary, the pooled row) and the output row. Online prefill: every input row once, ape once, and
per segment row its plan, the stored state it merges (if it continues a chunk) and its output row
(plan_c) or stored state (plan_w). The plain c128 rows use bench/compress.py's count. Reported
against the measured copy bandwidth and against 4.2 TB/s (``pct_peak``). Times: L2-cold eager and
graph, and warm.
"""

from __future__ import annotations

import torch

from ..ops import compress_forward
from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from . import compress, report, timing

HD = 512
PEAK_GBS = 4200.0


class OnlineCase:
    def __init__(self, seq, ext, decode, state_dtype=torch.float32):
        dev = torch.device("cuda")
        batch = len(seq)
        rpi = torch.arange(batch, dtype=torch.int64, device=dev)
        r2t = torch.zeros(batch, 1, dtype=torch.int32, device=dev)
        sb = state_dtype.itemsize
        self.state = torch.randn(batch, 1, 3 * HD, device=dev)
        self.state[:, :, HD:2 * HD].abs_().add_(1.0)  # running sums are >= 1
        self.state = self.state.to(state_dtype)
        seq_t = torch.tensor(seq, dtype=torch.int64)
        if decode:
            self.plan = CompressorDecodePlan.generate_online(seq_t.to(dev), rpi, r2t)
            tokens = batch
            loads = sum((s - 1) % 128 != 0 for s in seq)
            emits = sum(s % 128 == 0 for s in seq)
            self.bytes = (batch * (16 + 2 * HD * 4 + HD * 4 + HD * 4)  # plan, input, ape row, output row
                          + (loads + batch - emits) * 3 * HD * sb)
        else:
            tokens = sum(ext)
            self.plan = CompressorPrefillPlan.generate_online(seq_t, torch.tensor(ext, dtype=torch.int64), rpi, r2t,
                                                              tokens)
            c, w = self.plan.rows()
            # a segment merges a stored state unless it starts at chunk offset 0
            merges = sum(int((r.valid & (r.segment_len < (r.seq_len - 1) % 128 + 1)).sum()) for r in (c, w))
            self.bytes = (tokens * 2 * HD * 4 + 128 * HD * 4 + 16 * (len(c.valid) + len(w.valid))
                          + merges * 3 * HD * sb + int(c.valid.sum()) * HD * 4 + int(w.valid.sum()) * 3 * HD * sb)
        self.input = 2 * torch.randn(tokens, 2 * HD, device=dev)
        self.ape = torch.randn(128, HD, device=dev)
        self.out = torch.empty(self.plan.plan_rows.shape[0], HD, device=dev)

    def __call__(self):
        compress_forward(self.state, self.input, self.ape, self.plan, head_dim=HD, compress_ratio=128, out=self.out,
                         is_online=True)


def cases() -> list[tuple]:
    """(name, seq_lens, extend_lens or None for decode)."""
    c = []
    for b in (1, 16, 128, 256):
        c.append((f"decode B={b} boundary", [512 + 128 * (i % 8) for i in range(b)], None))
        c.append((f"decode B={b} off-boundary", [513 + 128 * (i % 8) for i in range(b)], None))
    c += [(f"prefill 1x{n}", [n], [n]) for n in (8192, 32768)]
    return c


def run(only: str = "") -> list[timing.Row]:
    bandwidth = timing.Bandwidth("online")

    def measure(name, case):
        row = bandwidth.measure(name, case.bytes, case)
        row.ratios["pct_peak"] = 100 * row.gbs / PEAK_GBS

    for name, seq, ext in cases():
        for state_dtype, tag in ((torch.float32, ""), (torch.bfloat16, " bf16-state")):
            online = f"online {name}{tag}"
            if only in online:
                measure(online, OnlineCase(seq, ext, ext is None, state_dtype))
        plain = f"plain c128 {name}"
        if only in plain:
            measure(plain, compress.Case(plain, 128, HD, seq, ext, ext is None))
    return bandwidth.rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
