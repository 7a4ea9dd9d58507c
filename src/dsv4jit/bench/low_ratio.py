"""The DeepSeek-V4.1 ratio-1 and ratio-2 compressors: ``c1_decode_norm_rope_store``,
``c2_decode_norm_rope_store`` and ``c2_prefill_norm_rope_store``, one layer's call each: µs (L2-cold eager
and graph, and warm), bytes moved, GB/s and % of the measured copy bandwidth.

    python -m dsv4jit.bench.low_ratio [--json] [--only TEXT] [--against MODULE]

Inputs, cache and per-token metadata are those of one layer of ``bench.step``'s V4.1 model (decode
batches of random lengths, prefills without a prefix; the metadata from ``low_ratio_metadata``).
``--against MODULE`` times the same call of another implementation of the API right after ours;
"MODULE / dsv4jit" > 1 means dsv4jit is faster.

Bytes count what the op must move at least: each token's input row read once, its positions, slot and
(ratio 2) request entries, every stored token's cache bytes, rope-table row and bf16 latent written or
read once; ratio 2 also the partner rows it reads from the pair ring and the rows it parks there.
"""

from __future__ import annotations

import importlib

import torch

from ..geometry import ROPE_DIM, store_format, written_bytes
from . import report, step, timing

#: Bytes of a token's rope-table row (complex64, ROPE_DIM / 2 pairs) and of its bf16 latent.
FREQ_ROW, LATENT_ROW = 4 * ROPE_DIM, 2 * 512
SHAPES = [step.Shape(16, True, 512, 16384), step.Shape(256, True, 512, 6144, seed=8),
          step.Shape(2048, True, 512, 4096, seed=9), step.Shape(1, False, tokens=8192),
          step.Shape(4, False, tokens=2048)]


class Case:
    """One ratio-1 or ratio-2 layer of the V4.1 model in `layout`, at one shape."""

    def __init__(self, ratio: int, layout: str, shape: step.Shape, device: torch.device):
        self.ratio, self.layout = ratio, layout
        self.batch = step.Batch(shape, device)
        self.meta = step.metadata(self.batch)
        model = step.Model(f"c{ratio}", {ratio: 1}, "v41", low=layout)
        self.layer = step.Layer(ratio, model, self.batch, seed=1000)
        self.bytes = self._bytes()

    def _bytes(self) -> int:
        tokens = self.batch.num_tokens
        per_token_in = 512 * self.ratio * self.layer.parts[0]["input"].element_size() + 8 + 8
        stored = written_bytes(store_format(512, layout=self.layout)) + FREQ_ROW + LATENT_ROW
        if self.ratio == 1:
            return tokens * (per_token_in + stored) + 1024
        closing = int((self.meta.positions % 2 == 1).sum())
        row = 2 * 512 * 4  # a pair-ring row: | kv | score | fp32
        if self.batch.shape.decode:  # every token reads its partner from the ring or parks itself there
            ring = tokens * row
        else:  # a request's first token may pair with the ring; its last rows are written back
            ring = len(self.batch.lens) * (1 + step.C2_RING) * row
        return tokens * (per_token_in + 8) + closing * stored + ring + 1024

    def through(self, api):
        """The layer's one call through `api` (a module with dsv4jit's API), on copies of its own."""
        (call,) = self.layer.calls(api, None, self.meta).calls
        return call


def cases() -> list[tuple[str, int, str, step.Shape]]:
    out = []
    for ratio in (1, 2):
        for layout in ("v41_fp4", "v4"):
            for shape in SHAPES:
                out.append((f"c{ratio} {layout} {shape.label}", ratio, layout, shape))
    return out


def run(only: str = "", against: str | None = None) -> list[timing.Row]:
    import dsv4jit

    other = importlib.import_module(against) if against else None
    device = torch.device("cuda", torch.cuda.current_device())
    bandwidth = timing.Bandwidth("low_ratio")
    for name, ratio, layout, shape in cases():
        if only in name:
            case = Case(ratio, layout, shape, device)
            bandwidth.measure(name, case.bytes, case.through(dsv4jit),
                              {against: case.through(other)} if other else None)
    return bandwidth.rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv, against=True)


if __name__ == "__main__":
    main()
