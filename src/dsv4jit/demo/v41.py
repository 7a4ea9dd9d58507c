"""``demo --model v4.1``: the compressors of a DeepSeek-V4.1-like model driven as a serving stack drives
them. Layers cycle through compress ratios 4, 128, 1 and 2; ratios 4 and 128 store into the ``v41``
layout (the fp8 encoding beside a ``v41`` main cache), ratios 1 and 2 into ``v41_fp4`` (the fp4 one,
upstream's default for them). The flow: chunked prefill steps, decode steps, then one speculative
verify step of ``verify_tokens`` drafts per request, every draft accepted (ratios 4 and 128 take it as
an extend, ratios 1 and 2 as their verify). Ratios 4 and 128 get plans per step; ratios 1 and 2 the
per-token metadata of ``low_ratio_metadata``. The final state rings, pair rings and caches are compared
with the same flow on the reference backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..geometry import V4_HEAD_DIM
from ..kv_layout import KVLayout
from ..ops import c1_decode_norm_rope_store, c2_decode_norm_rope_store, c2_prefill_norm_rope_store
from ..token_metadata import LowRatioMetadata, low_ratio_metadata
from .check import Check, compare_cache, compare_engines, compare_state
from .engine import Engine, Timer
from .layer import C4_INDEXER_FP4, NORM_EPS, CompressorSpec
from .pool import SWA_PAGE, PagedPool, Step, out_loc, schedule
from .run import CPU, Phase, Progress, check_sizes
from .run import make_inputs as v4_inputs

RATIO_CYCLE = (4, 128, 1, 2)
CORE_LAYOUT, LOW_LAYOUT = "v41", "v41_fp4"
C4_CORE_V41 = CompressorSpec("c4 core", 4, V4_HEAD_DIM, CORE_LAYOUT)
C128_CORE_V41 = CompressorSpec("c128 core", 128, V4_HEAD_DIM, CORE_LAYOUT)
#: What each ratio's layer stores, for the report.
LAYER_STORES = {4: f"core {CORE_LAYOUT}, indexer {C4_INDEXER_FP4.store}", 128: CORE_LAYOUT, 1: LOW_LAYOUT,
                2: LOW_LAYOUT}


@dataclass(frozen=True)
class V41Config:
    requests: int = 8
    min_prompt: int = 64
    max_prompt: int = 1024
    chunk: int = 1024           # prefill token budget per step
    decode_steps: int = 32
    layers: int = 4             # cycling through ratios 4, 128, 1, 2
    verify_tokens: int = 3      # drafts per request in the verify step
    seed: int = 0
    check: bool = True

    def validate(self) -> None:
        check_sizes(self, ("requests", "min_prompt", "chunk", "layers"))


GPU_V41 = V41Config()
CPU_V41 = V41Config(requests=3, min_prompt=60, max_prompt=300, chunk=256, decode_steps=8)


class LowRatioLayer:
    """A ratio-1 or ratio-2 layer's compressor on one device: its norm weight, its cache in LOW_LAYOUT
    and, for ratio 2, its pair ring (kv 0 and score -inf in every row, as a fresh ring is)."""

    def __init__(self, ratio: int, pool: PagedPool, ring_size: int, gen: torch.Generator, device: torch.device):
        self.ratio, self.ring_size, self.name = ratio, ring_size, f"c{ratio} core"
        self.page_size = SWA_PAGE // ratio
        layout = KVLayout(LOW_LAYOUT)
        self.cache = torch.zeros(pool.num_full_pages, layout.page_bytes(self.page_size), dtype=torch.uint8,
                                 device=device)
        self.norm_weight = (0.5 + torch.rand(V4_HEAD_DIM, generator=gen)).to(torch.bfloat16).to(device)
        self.ring = None
        if ratio == 2:
            rows = pool.num_slots * ring_size + ring_size + 1
            self.ring = torch.zeros(rows + rows % 2, 2 * V4_HEAD_DIM, device=device)
            self.ring[:, V4_HEAD_DIM:] = float("-inf")

    def step(self, kind: str, meta: LowRatioMetadata, kv_input: torch.Tensor, freq_cis: torch.Tensor,
             draft_len: int) -> None:
        common = dict(page_size=self.page_size, layout=LOW_LAYOUT)
        if self.ratio == 1:  # decode, verify and extend alike
            c1_decode_norm_rope_store(kv_input, self.norm_weight, meta.positions, meta.raw_out_loc, NORM_EPS,
                                      freq_cis, self.cache, **common)
            return
        args = (kv_input, self.ring, self.norm_weight, meta.positions, meta.req, meta.raw_out_loc, NORM_EPS,
                freq_cis, self.cache)
        if kind == "prefill":
            c2_prefill_norm_rope_store(*args, meta.extend_start_loc, meta.extend_seq_lens, ring_size=self.ring_size,
                                       **common)
        else:
            c2_decode_norm_rope_store(*args, ring_size=self.ring_size, draft_len=draft_len, **common)


class V41Engine:
    """One backend's copy of the model state: the ratio-4/128 layers (an Engine over V4.1 layouts) and
    the ratio-1/2 layers, in layer order."""

    def __init__(self, device: torch.device, pool: PagedPool, ratios: list[int], verify_tokens: int, seed: int):
        self.device = device
        specs = [(C4_CORE_V41, C4_INDEXER_FP4) if r == 4 else (C128_CORE_V41,) for r in ratios if r in (4, 128)]
        self.v4 = Engine(device, pool, specs, seed, fused=True)
        ring_size = 1 << (verify_tokens + 1).bit_length()  # a power of two above the drafts
        gen = torch.Generator().manual_seed(seed + 1)
        self.low = [LowRatioLayer(r, pool, ring_size, gen, device) for r in ratios if r in (1, 2)]

    def run(self, s: Step, kind: str, inputs: tuple, timer: Timer) -> None:
        """One step: `kind` "prefill", "decode" or "verify" (an extend of the drafts for ratios 4 and 128)."""
        e = self.v4
        v4_inputs = e.to_device(inputs[0])
        low_inputs = [x.to(self.device) for x in inputs[1]]
        slots, seq, ext = (torch.tensor(v, dtype=torch.int64, device=self.device)
                           for v in (s.slots, s.seq_lens, s.extend_lens))
        start = timer.mark()
        if kind == "decode":
            plans, out_locs = e.decode_plans(slots, seq), e.decode_out_locs(slots, seq)
        else:
            plans, out_locs = e.prefill_plans(s), e.prefill_out_locs(s)
        meta = low_ratio_metadata(slots, seq, ext, e.req_to_token, s.num_tokens)
        e.run_layers(plans, v4_inputs, out_locs)
        for layer, x in zip(self.low, low_inputs):
            layer.step("prefill" if kind == "prefill" else "decode", meta, x, e.freq_cis, max(s.extend_lens))
        timer.add(kind, start, timer.mark())


def make_inputs(s: Step, engine_specs: list, low_ratios: list[int], gen: torch.Generator) -> tuple:
    """The projections standing in for the GEMMs, kv ~ N(0, 1) and scores ~ N(0, 4): the ratio-4/128
    layers' kv_score rows, ratio 1's bf16 kv rows, ratio 2's fp32 kv | score rows."""
    low = []
    for r in low_ratios:
        x = torch.randn(s.num_tokens, V4_HEAD_DIM * r, generator=gen)
        x[:, V4_HEAD_DIM:] *= 2.0
        low.append(x.to(torch.bfloat16) if r == 1 else x)
    return v4_inputs(s, engine_specs, gen), low


def stored_locs(pool: PagedPool, s: Step) -> dict[int, torch.Tensor]:
    """Per ratio, the cache locations this step stores: an event's (ratios 4, 128), every token's full
    slot (ratio 1), the pair's slot at odd positions (ratio 2)."""
    slots, positions = s.token_positions()
    raw = pool.req_to_token[slots, positions].to(torch.int64)
    locs = {r: out_loc(pool.req_to_token, slots, positions, r) for r in (4, 128)}
    locs[1], locs[2] = raw, torch.where(positions % 2 == 1, raw // 2, 0)
    return {r: v[v > 0] for r, v in locs.items()}


@dataclass
class V41Result:
    ok: bool
    device: str
    device_name: str
    backend: str
    config: dict
    prompt_lens: list[int]
    layer_kinds: list[str]
    phases: list[Phase] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def run_v41(config: V41Config, device: torch.device, *, progress: bool = False,
            before_check: Callable[[V41Engine], None] | None = None) -> V41Result:
    """Run the flow; ``before_check(engine)`` may alter the engine under test before the comparison."""
    config.validate()
    gen = torch.Generator().manual_seed(config.seed)
    prompt_lens = torch.randint(config.min_prompt, config.max_prompt + 1, (config.requests,), generator=gen).tolist()
    num_slots = config.requests + 2
    pool = PagedPool(num_slots, max(prompt_lens) + config.decode_steps + config.verify_tokens, gen)
    slots = torch.randperm(num_slots, generator=gen)[:config.requests].tolist()
    steps = [(s.kind, s) for s in schedule(prompt_lens, slots, config.chunk, config.decode_steps)]
    last = steps[-1][1]
    steps.append(("verify", Step("verify", last.slots, tuple(n + config.verify_tokens for n in last.seq_lens),
                                 (config.verify_tokens,) * len(last.slots))))
    ratios = [RATIO_CYCLE[i % len(RATIO_CYCLE)] for i in range(config.layers)]
    engine = V41Engine(device, pool, ratios, config.verify_tokens, config.seed + 1)
    reference = V41Engine(CPU, pool, ratios, config.verify_tokens, config.seed + 1) if config.check else None
    low_ratios = [layer.ratio for layer in engine.low]
    engine_specs = [[comp.spec for comp in layer] for layer in engine.v4.layers]
    timer, ref_timer = Timer(device), Timer(CPU)
    stored: dict[int, list[torch.Tensor]] = {r: [] for r in (1, 2, 4, 128)}
    bar = Progress(len(steps), progress)
    for i, (kind, s) in enumerate(steps):
        inputs = make_inputs(s, engine_specs, low_ratios, gen)
        for r, locs in stored_locs(pool, s).items():
            stored[r].append(locs)
        engine.run(s, kind, inputs, timer)
        if reference is not None:
            reference.run(s, kind, inputs, ref_timer)
        bar.update(i + 1)
    bar.close()

    phases = []
    for kind in ("prefill", "decode", "verify"):
        n, total_us, _ = timer.totals(kind)
        if n:
            tokens = sum(s.num_tokens for k, s in steps if k == kind)
            phases.append(Phase(kind, "eager", n, tokens, total_us / n, total_us / (n * config.layers),
                                tokens / (total_us * 1e-6) if total_us > 0 else float("inf"), None))
    if before_check is not None:
        before_check(engine)
    checks = [] if reference is None else compare(engine, reference, ratios, {r: torch.cat(v) for r, v in stored.items()})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    kinds = [f"c{r} ({LAYER_STORES[r]})" for r in ratios]
    return V41Result(ok=all(c.ok for c in checks), device=str(device), device_name=name,
                     backend="kernels" if device.type == "cuda" else "reference", config=asdict(config),
                     prompt_lens=prompt_lens, layer_kinds=kinds, phases=phases, checks=checks)


def compare(engine: V41Engine, reference: V41Engine, ratios: list[int], locs: dict[int, torch.Tensor]) -> list[Check]:
    """Every layer's state rings (bit-identical), pair rings (bit-identical) and caches, in layer order."""
    v4_layers = [i for i, r in enumerate(ratios) if r in (4, 128)]
    checks = compare_engines(engine.v4, reference.v4, locs)
    for check in checks:  # the V4 engine numbers its own layers
        check.layer = v4_layers[check.layer]
    low_layers = [i for i, r in enumerate(ratios) if r in (1, 2)]
    for at, got, want in zip(low_layers, engine.low, reference.low):
        if got.ring is not None:
            checks.append(Check(at, got.name, "ring", *compare_state(got.ring, want.ring)))
        checks.append(Check(at, got.name, "cache",
                            *compare_cache(LOW_LAYOUT, got.page_size, got.cache, want.cache, locs[got.ratio])))
    return sorted(checks, key=lambda c: c.layer)


def format_v41(result: V41Result) -> list[str]:
    cfg = result.config
    backend = "CUDA kernels" if result.backend == "kernels" else "the torch reference backend (CPU tensors)"
    lines = [f"dsv4jit demo --model v4.1 on {result.device_name} ({result.device}): {backend}",
             f"requests {cfg['requests']} (prompts {min(result.prompt_lens)}-{max(result.prompt_lens)}), prefill "
             f"chunk {cfg['chunk']} tokens, {cfg['decode_steps']} decode steps, one verify step of "
             f"{cfg['verify_tokens']} drafts per request (all accepted), seed {cfg['seed']}",
             f"layers {cfg['layers']}: " + "; ".join(result.layer_kinds), "",
             f"{'phase':8s} {'mode':6s} {'steps':>6s} {'tokens':>8s} {'µs/step':>10s} {'µs/layer-step':>14s}"]
    for p in result.phases:
        lines.append(f"{p.phase:8s} {p.mode:6s} {p.steps:6d} {p.tokens:8d} {p.us_per_step:10.1f} "
                     f"{p.us_per_layer_step:14.1f}")
    lines.append("")
    if not result.checks:
        return lines + ["not checked against the reference backend (--no-check)"]
    what = ("the reference backend (CPU)" if result.backend == "kernels"
            else "a second reference run (no kernels here: this checks the flow, not the kernels)")
    lines.append(f"final states, rings and caches against {what}:")
    for c in result.checks:
        lines.append(f"  layer {c.layer:<3d} {c.compressor:11s} {c.part:5s} {'ok ' if c.ok else 'MISMATCH'}  {c.detail}")
    failed = sum(not c.ok for c in result.checks)
    lines.append("every state, ring and cache matched" if not failed
                 else f"{failed} of {len(result.checks)} checks FAILED")
    return lines
