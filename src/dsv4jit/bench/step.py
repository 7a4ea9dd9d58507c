"""The compressor work of one whole forward step of a model, as a serving stack runs it: every
compressor of every layer, each layer with its own state, input and cache tensors (nothing of one
layer is in L2 for the next), requests of random lengths (only those at a boundary pool a window).

    python -m dsv4jit.bench.step [--json] [--only TEXT] [--against MODULE]

Models: DeepSeek-V4-Pro (30 c4 + 31 c128 layers) and -Flash (21 + 20) storing the V4 formats, Pro with
every c128 layer on the online compressor (``pro-online``: a constant-size state per request), and a
DeepSeek-V4.1-like model (its layer counts are not public: 11 c4, 10 c128, 10 ratio-1 and 10 ratio-2
layers, and 2 without a compressor) storing ``v41`` (ratios 4, 128) and ``v41_fp4`` (ratios 1, 2). A c4
layer's core and indexer compressors share its plan and rope table. Plans (ratios 4, 128) and the
per-token metadata (ratios 1, 2) are built once per step, outside the timed region. dsv4jit runs one op
per layer (``compress_and_store_c4_layer``, ``compress_and_store``, the ratio-1/2 ops). Times: the whole
step eagerly and as one CUDA graph, L2-cold (bench/timing.py); the headline is the faster. "launch floor":
one graph of as many launches of an empty kernel as the step has calls (what the launches alone cost).

``--against MODULE`` runs another implementation of the same API (same names and signatures, such as
the reference behind ../shared/peer/peer_api.py) on identical inputs, side by side; an op it lacks is
run as the two calls it replaces (``compress_forward`` + ``compress_norm_rope_store``). Each row then
gives both times, their ratios (> 1: dsv4jit is faster) and the share of cache bytes that differ after
one step (rounding ties flip a code: a few per cent at most; more means the two did different work).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import runtime
from ..geometry import page_bytes, store_format
from . import report, timing

SPS = 256                                  # full and SWA page size
RING = {4: 8, 128: 128}                    # state ring rows per page (c4) or per request slot (c128)
PAGE = {1: 256, 2: 128, 4: 64, 128: 2}     # compressed tokens per cache page: 256 / R
C2_RING = 2                                # the ratio-2 pair ring without speculative decoding
EPS = 1e-6


@dataclass(frozen=True)
class Model:
    name: str
    layers: dict[int, int]   # compress ratio -> layers
    core: str                # the 512-dim cache format of ratios 4 and 128
    low: str = "v41_fp4"     # the layout of ratios 1 and 2
    online: bool = False     # ratio 128 on the online compressor (contract §5) instead of the ring

    def is_online(self, ratio: int) -> bool:
        """Whether the layers of `ratio` run the online compressor."""
        return self.online and ratio == 128


MODELS = {m.name: m for m in (Model("pro", {4: 30, 128: 31}, "v4_fp8"), Model("flash", {4: 21, 128: 20}, "v4_fp8"),
                              Model("pro-online", {4: 30, 128: 31}, "v4_fp8", online=True),
                              Model("v4.1", {4: 11, 128: 10, 1: 10, 2: 10}, "v41"))}


@dataclass(frozen=True)
class Shape:
    """A decode batch of `bs` requests of lengths uniform in [lo, hi), or a prefill of bs x tokens."""
    bs: int
    decode: bool
    lo: int = 0
    hi: int = 0
    tokens: int = 0
    seed: int = 7

    @property
    def label(self) -> str:
        return f"decode bs{self.bs} lens {self.lo}-{self.hi}" if self.decode else f"prefill {self.bs}x{self.tokens}"

    def lengths(self) -> list[int]:
        if not self.decode:
            return [self.tokens] * self.bs
        return torch.randint(self.lo, self.hi, (self.bs,), generator=torch.Generator().manual_seed(self.seed)).tolist()


SHAPES = [Shape(16, True, 512, 16384), Shape(128, True, 512, 16384), Shape(256, True, 512, 6144, seed=8),
          Shape(2, False, tokens=4096)]


class Batch:
    """The step's requests in a paged pool: slot b owns shuffled full pages; the SWA pool holds the
    pages a step reads (in decode the last two of each request, the c4 window's; all in prefill)."""

    def __init__(self, shape: Shape, device: torch.device):
        self.shape, self.device = shape, device
        lens = shape.lengths()
        bs, pages = len(lens), -(-(max(lens) + 1) // SPS)
        g = torch.Generator().manual_seed(shape.seed + 1)
        owned = (torch.randperm(bs * pages, generator=g) + 1).view(bs, pages)
        pos = torch.arange(pages * SPS)
        self.req_to_token = (owned[:, pos // SPS] * SPS + pos % SPS).to(torch.int32).to(device)
        swa = torch.full((bs * pages + 1,), -1, dtype=torch.int64)
        resident = [owned[b, max(0, (n - 1) // SPS - 1):(n - 1) // SPS + 1] if shape.decode else owned[b, :]
                    for b, n in enumerate(lens)]
        resident = torch.cat(resident)
        swa[resident] = torch.arange(resident.numel())
        self.swa_pages = resident.numel()
        slots = swa[:, None] * SPS + torch.arange(SPS)
        slots[swa < 0] = -1
        self.full_to_state = torch.cat([slots.reshape(-1), torch.tensor([-1])]).to(device)
        self.rpi = torch.arange(bs, device=device)
        self.lens = lens
        self.seq = torch.tensor(lens, device=device)
        self.ext = torch.ones(bs, dtype=torch.int64, device=device) if shape.decode else self.seq.clone()
        self.num_tokens = bs if shape.decode else sum(lens)

    def plan(self, api, ratio: int, online: bool = False):
        """The step's plan of a ratio through `api` (`online`: the online c128 compressor's)."""
        if self.shape.decode:
            if online:
                return api.CompressorDecodePlan.generate_online(self.seq, self.rpi, self.req_to_token)
            return api.CompressorDecodePlan.generate(ratio, self.rpi, self.req_to_token, self.full_to_state, self.seq,
                                                     SPS, RING[ratio])
        host = torch.tensor(self.lens)
        if online:
            return api.CompressorPrefillPlan.generate_online(host, host, self.rpi, self.req_to_token, self.num_tokens)
        return api.CompressorPrefillPlan.generate(ratio, self.rpi, host, host, self.req_to_token, self.full_to_state,
                                                  SPS, RING[ratio], self.num_tokens)

    def state_rows(self, ratio: int) -> int:
        return self.swa_pages * RING[4] if ratio == 4 else len(self.lens) * RING[128]


def _randn(shape, seed: int, device, dtype=None) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype or torch.float32)


def _cache(fmt: str, ratio: int, slots: int, seed: int, device) -> torch.Tensor:
    """A cache of random bytes holding compressed slots [0, slots)."""
    pages = -(-slots // PAGE[ratio]) + 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, page_bytes(fmt, PAGE[ratio])), dtype=torch.uint8, generator=g).to(device)


@dataclass(frozen=True)
class Bound:
    """Calls bound to an API (a layer's or a whole step's): the calls in order, the caches they write,
    and the kernels they launch (each op one; the two-step pair of an op an implementation lacks two)."""
    calls: list[Callable[[], object]]
    caches: list[torch.Tensor]
    launches: int

    def run(self) -> None:
        for call in self.calls:
            call()


class Layer:
    """One layer's tensors (weights, inputs, the state it starts from, its cache as it starts) and the
    calls of one step of it through an API, on copies of the state and the cache of its own."""

    def __init__(self, ratio: int, model: Model, batch: Batch, seed: int):
        self.ratio, self.batch, self.seed = ratio, batch, seed
        self.online = model.is_online(ratio)
        dev = batch.device
        angles = _randn((max(batch.lens) + 1, 32), seed, "cpu")
        self.freq = torch.polar(torch.ones_like(angles), angles).to(dev)
        if ratio in (4, 128):
            hds = (512, 128) if ratio == 4 else (512,)
            self.parts = [self._compressor(hd, model.core if hd == 512 else "indexer_fp4", seed + 10 * i)
                          for i, hd in enumerate(hds)]
        else:
            self.parts = [self._low(model.low, seed)]

    def _compressor(self, hd: int, fmt: str, seed: int) -> dict:
        b, dev, ratio = self.batch, self.batch.device, self.ratio
        width = (4 if ratio == 4 else 2) * hd
        rows = b.num_tokens  # out_loc entries: one per token (prefill) or per request (decode)
        g = torch.Generator().manual_seed(seed)
        if self.online:  # a request's (running max, running sum >= 1, average) of its open chunk
            state = _randn((len(b.lens), 1, 3 * hd), seed + 2, dev)
            state[..., hd:2 * hd].abs_().add_(1.0)
        else:
            state = _randn((b.state_rows(ratio) // ratio, ratio, width), seed + 2, dev)
        return dict(hd=hd, fmt=fmt, input=_randn((b.num_tokens, width), seed, dev),
                    ape=_randn((8 if ratio == 4 else 128, hd), seed + 1, dev), state=state,
                    weight=1.0 + 0.3 * _randn((hd,), seed + 3, dev),
                    out_loc=(torch.randperm(2 * rows, generator=g)[:rows] + 1).to(dev),
                    cache=_cache(fmt, ratio, 2 * rows + 2, seed + 4, dev))

    def _low(self, layout: str, seed: int) -> dict:
        b, dev, r = self.batch, self.batch.device, self.ratio
        ring = None
        if r == 2:
            rows = len(b.lens) * C2_RING + C2_RING + 1
            ring = _randn((rows + rows % 2, 1024), seed + 2, dev)
        return dict(fmt=layout, input=_randn((b.num_tokens, 512 * r), seed, dev, torch.bfloat16 if r == 1 else None),
                    weight=(1.0 + 0.3 * _randn((512,), seed + 3, dev)).to(torch.bfloat16), ring=ring,
                    cache=_cache(store_format(512, layout=layout), r, 2 * b.num_tokens + SPS, seed + 4, dev))

    def calls(self, api, plan, meta) -> Bound:
        """The layer's calls through `api` on fresh copies of the state, and the caches they write."""
        parts = [dict(p, state=p["state"].clone() if "state" in p else None,
                      ring=None if p.get("ring") is None else p["ring"].clone(), cache=p["cache"].clone())
                 for p in self.parts]
        caches = [p["cache"] for p in parts]
        if self.ratio in (1, 2):
            return Bound([self._low_call(api, parts[0], meta)], caches, 1)
        layer_op = getattr(api, "compress_and_store_c4_layer", None)
        if self.ratio == 4 and layer_op is not None:
            core, idx = parts
            return Bound([lambda: layer_op(core["state"], core["input"], core["ape"], idx["state"], idx["input"], idx["ape"],
                                     plan, norm_weight=core["weight"], indexer_norm_weight=idx["weight"], norm_eps=EPS,
                                     freq_cis=self.freq, out_loc=core["out_loc"], kvcache=core["cache"],
                                     page_size=PAGE[4], indexer_kvcache=idx["cache"], indexer_out_loc=idx["out_loc"],
                                     indexer_page_size=PAGE[4], use_fp4=True, **_layout(core["fmt"]))], caches, 1)
        fused = getattr(api, "compress_and_store", None)  # else two launches a compressor
        return Bound([self._compressor_call(api, fused, p, plan) for p in parts], caches,
                     len(parts) * (1 if fused is not None else 2))

    def _compressor_call(self, api, fused, p: dict, plan):
        """A compressor's step: `fused` (api's compress_and_store) where the API has it, else its two calls."""
        store = dict(norm_weight=p["weight"], norm_eps=EPS, freq_cis=self.freq, out_loc=p["out_loc"],
                     kvcache=p["cache"], page_size=PAGE[self.ratio], use_fp4=p["fmt"] == "indexer_fp4",
                     **_layout(p["fmt"]))
        op = dict(head_dim=p["hd"], compress_ratio=self.ratio, **({"is_online": True} if self.online else {}))
        if fused is not None:
            return lambda: fused(p["state"], p["input"], p["ape"], plan, **op, **store)
        rows = torch.empty(plan[1].shape[0], p["hd"], device=self.batch.device)  # plan[1]: its rows, in both APIs

        def two_step():
            api.compress_forward(p["state"], p["input"], p["ape"], plan, **op, out=rows)
            api.compress_norm_rope_store(rows, plan, **store)
        return two_step

    def _low_call(self, api, p: dict, meta):
        common = dict(page_size=PAGE[self.ratio], layout=p["fmt"])
        freqs = torch.view_as_real(self.freq).flatten(-2)  # fp32 [max_pos, 64], as upstream's ratio-1/2 ops take it
        if self.ratio == 1:
            return lambda: api.c1_decode_norm_rope_store(p["input"], p["weight"], meta.positions, meta.raw_out_loc, EPS,
                                                         freqs, p["cache"], **common)
        args = (p["input"], p["ring"], p["weight"], meta.positions, meta.req, meta.raw_out_loc, EPS, freqs, p["cache"])
        if self.batch.shape.decode:
            return lambda: api.c2_decode_norm_rope_store(*args, ring_size=C2_RING, **common)
        return lambda: api.c2_prefill_norm_rope_store(*args, meta.extend_start_loc, meta.extend_seq_lens,
                                                      ring_size=C2_RING, **common)


def _layout(fmt: str) -> dict:
    """The layout argument of a store into `fmt`: none for the V4 formats (every implementation's default)."""
    return {} if fmt.startswith(("v4_", "indexer_")) else {"layout": fmt}


def metadata(batch: Batch):
    """The ratio-1/2 per-token metadata of the step, full slots spread so that no two rows share a cache
    slot (the kernels read only these tensors, not the table)."""
    from ..token_metadata import low_ratio_metadata

    meta = low_ratio_metadata(batch.rpi, batch.seq, batch.ext, batch.req_to_token, batch.num_tokens)
    g = torch.Generator().manual_seed(batch.shape.seed + 2)
    spread = SPS + 2 * torch.randperm(batch.num_tokens, generator=g).to(batch.device) + meta.positions % 2
    return meta._replace(raw_out_loc=spread, c1_out_loc=spread)


class Step:
    """A model's step at one shape: its layers, then per API the calls of one step."""

    def __init__(self, model: Model, shape: Shape, device: torch.device):
        self.batch, self.model = Batch(shape, device), model
        ratios = [r for r, count in model.layers.items() for _ in range(count)]
        self.layers = [Layer(r, model, self.batch, seed=1000 + 100 * i) for i, r in enumerate(ratios)]
        self.meta = metadata(self.batch) if any(r in (1, 2) for r in ratios) else None

    def bind(self, api) -> Bound:
        """One step through `api`: its calls, the caches they write (layer by layer), its launches."""
        plans = {r: self.batch.plan(api, r, self.model.is_online(r)) for r in (4, 128)}
        layers = [layer.calls(api, plans.get(layer.ratio), self.meta) for layer in self.layers]
        return Bound([c for b in layers for c in b.calls], [k for b in layers for k in b.caches],
                     sum(b.launches for b in layers))


def launch_floor_us(launches: int, device: torch.device) -> float:
    """What a step of `launches` kernels costs at least on the GPU: one CUDA graph (L2-cold, as the
    steps) of as many launches of a kernel with no work (selftest.affine on one value), chained by
    programmatic dependent launch as the ops are."""
    x = torch.zeros(1, device=device)
    out = torch.empty_like(x)
    affine = runtime.function("selftest", "affine", device, dtype="fp32")  # PDL as the ops have it

    def step():
        for _ in range(launches):
            affine(x, out, 1.0, 0.0)
    return timing.graph_us(step, 3, 20)


def differing_share(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """The largest share, over the layers' caches, of bytes that differ."""
    return max(float((a != b).float().mean()) for a, b in zip(ours, theirs))


def run(only: str = "", against: str | None = None, device: torch.device | None = None) -> list[timing.Row]:
    import dsv4jit

    device = device or torch.device("cuda", torch.cuda.current_device())
    apis = {"dsv4jit": dsv4jit, **({against: importlib.import_module(against)} if against else {})}
    rows = []
    for model in MODELS.values():
        for shape in SHAPES:
            case = f"{model.name} {shape.label}"
            if only not in case:
                continue
            step = Step(model, shape, device)
            bound = {name: step.bind(api) for name, api in apis.items()}
            for b in bound.values():  # one step each, on the caches as they start: compared below
                b.run()
            differ = differing_share(bound["dsv4jit"].caches, bound[against].caches) if against else None
            times = {}
            for name, b in bound.items():
                suffix = "" if name == "dsv4jit" else f" {name}"
                times[f"eager{suffix}"] = timing.event_us(b.run, 3, 20)
                times[f"graph{suffix}"] = timing.graph_us(b.run, 3, 20)
                times[f"launch floor{suffix}"] = launch_floor_us(b.launches, device)
            row = timing.Row.best_of("step", case, times)
            if against:
                for kind in ("eager", "graph"):
                    row.ratios[f"{against} / dsv4jit {kind}"] = times[f"{kind} {against}"] / times[kind]
                row.ratios["cache bytes differing %"] = 100 * differ
            rows.append(row)
            del step, bound
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    report.main(__doc__, run, argv, against=True)


if __name__ == "__main__":
    main()
