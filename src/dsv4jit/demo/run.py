"""The demo's driver: build the pool and the schedule, run every step on the engine under test and
on the reference backend with the same inputs, time it, compare the final states and caches."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from .. import runtime
from .check import Check, compare_engines
from .engine import DecodeGraph, Engine, Inputs, Timer
from .layer import CompressorSpec, layer_specs
from .pool import PagedPool, Step, out_loc, schedule

CPU = torch.device("cpu")


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 8
    min_prompt: int = 64
    max_prompt: int = 2048
    chunk: int = 2048            # prefill token budget per step
    decode_steps: int = 128
    layers: int = 2              # alternating c4 / c128
    seed: int = 0
    indexer_fp8: bool = False    # indexer cache in fp8 instead of fp4
    graph: bool = True           # capture the decode step in a CUDA graph (GPU only)
    decode_plans: str = "in-graph"  # "in-graph" or "copy" (see DecodeGraph)
    check: bool = True           # also run the reference backend and compare
    fused: bool = True           # one op per layer (compress_and_store_c4_layer, compress_and_store); else two per compressor

    def validate(self) -> None:
        check_sizes(self, ("requests", "min_prompt", "chunk", "layers"))
        if self.decode_plans not in ("in-graph", "copy"):
            raise ValueError(f"demo: decode_plans must be 'in-graph' or 'copy', got {self.decode_plans!r}")


def check_sizes(config, positive: tuple[str, ...]) -> None:
    """The size checks the demo's flows share, each a ValueError naming the option: `positive` are >= 1;
    decode_steps (where the flow has it) >= 0; the prompt range; chunk <= 65536 (a prefill step's
    ragged ids); verify_tokens in [1, 8] (the draft counts the verify ops take)."""
    for name in positive:
        if getattr(config, name) < 1:
            raise ValueError(f"demo: {name} must be >= 1, got {getattr(config, name)}")
    if getattr(config, "decode_steps", 0) < 0:
        raise ValueError(f"demo: decode_steps must be >= 0, got {config.decode_steps}")
    if config.max_prompt < config.min_prompt:
        raise ValueError(f"demo: max_prompt ({config.max_prompt}) must be >= min_prompt ({config.min_prompt})")
    if getattr(config, "chunk", 0) > 65536:
        raise ValueError(f"demo: chunk (tokens per prefill step) must be <= 65536, got {config.chunk}")
    if not 1 <= getattr(config, "verify_tokens", 1) <= 8:
        raise ValueError(f"demo: verify_tokens must be in [1, 8], got {config.verify_tokens}")


#: Defaults on a GPU, and the small size the reference backend runs when there is none.
GPU_DEFAULTS = DemoConfig()
CPU_DEFAULTS = DemoConfig(requests=3, min_prompt=100, max_prompt=400, chunk=256, decode_steps=40, layers=2)


@dataclass
class Phase:
    phase: str
    mode: str
    steps: int
    tokens: int
    us_per_step: float
    us_per_layer_step: float
    tokens_per_s: float
    plan_us_per_step: float | None  # None when the plans are built inside the decode graph


@dataclass
class DemoResult:
    ok: bool
    device: str
    device_name: str
    backend: str                 # "kernels" or "reference"
    config: dict
    prompt_lens: list[int]
    layer_kinds: list[str]
    load_seconds: float          # first use (loads; compiles on a cold cache), before any timed step
    phases: list[Phase] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"demo: device must be cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"demo: device {device!r} requested, but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    if dev.type != "cpu":
        raise ValueError(f"demo: device must be cpu or cuda[:N], got {device!r}")
    return dev


def make_inputs(s: Step, specs: list[tuple[CompressorSpec, ...]], gen: torch.Generator) -> Inputs:
    """kv_score rows standing in for the wkv_gate GEMM: kv ~ N(0, 1), scores ~ N(0, 4)."""
    inputs = []
    for layer in specs:
        rows = []
        for spec in layer:
            x = torch.randn(s.num_tokens, spec.last_dim, generator=gen)
            x[:, spec.last_dim // 2:] *= 2.0     # score columns are the second half in both layouts
            rows.append(x)
        inputs.append(rows)
    return inputs


def warm_up(device: torch.device, specs: list[tuple[CompressorSpec, ...]], fused: bool) -> float:
    """Load (compiling if needed) every kernel the flow uses on `device`, on a throwaway pool, so the
    timed steps run on a warm cache (the CPU backend still loads the compiled planner); returns seconds."""
    start = time.perf_counter()
    kinds = list(dict.fromkeys(specs))
    gen = torch.Generator().manual_seed(0)
    pool = PagedPool(1, 256, gen)
    engine = Engine(device, pool, kinds, seed=0, fused=fused)
    timer = Timer(device)
    for s in schedule([130], [0], 256, 1):
        run = engine.prefill if s.kind == "prefill" else engine.decode
        run(s, make_inputs(s, kinds, gen), timer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Progress:
    """A one-line bar on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and total > 0

    def update(self, done: int) -> None:
        if self.enabled:
            filled = 30 * done // self.total
            sys.stderr.write(f"\rdemo [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} steps")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def run_demo(config: DemoConfig, device: str | None = None, *, progress: bool = False,
             before_check: Callable[[Engine], None] | None = None) -> DemoResult:
    """Run the flow; ``before_check(engine)`` may alter the engine under test before the comparison."""
    config.validate()
    dev = resolve_device(device)
    gen = torch.Generator().manual_seed(config.seed)
    prompt_lens = torch.randint(config.min_prompt, config.max_prompt + 1, (config.requests,), generator=gen).tolist()
    num_slots = config.requests + 2                       # a few request slots stay free
    pool = PagedPool(num_slots, max(prompt_lens) + config.decode_steps, gen)
    slots = torch.randperm(num_slots, generator=gen)[:config.requests].tolist()
    steps = schedule(prompt_lens, slots, config.chunk, config.decode_steps)
    specs = layer_specs(config.layers, config.indexer_fp8)
    # First use loads (on a cold cache: compiles) the kernels, and the planner the reference backend runs
    # on the CPU; it is timed here, apart from the steps.
    load_seconds = warm_up(dev, specs, config.fused)
    if config.check and dev.type == "cuda":
        load_seconds += warm_up(CPU, specs, False)

    engine = Engine(dev, pool, specs, seed=config.seed + 1, fused=config.fused)
    reference = Engine(CPU, pool, specs, seed=config.seed + 1) if config.check else None
    timer, ref_timer = Timer(dev), Timer(CPU)
    use_graph = dev.type == "cuda" and config.graph and not runtime.checks_enabled()  # checked mode syncs
    graph = None
    stored: dict[int, list[torch.Tensor]] = {spec.ratio: [] for layer in specs for spec in layer}
    bar = Progress(len(steps), progress)
    for i, s in enumerate(steps):
        inputs = make_inputs(s, specs, gen)
        token_slots, positions = s.token_positions()
        for r, kept in stored.items():   # the locations this step must store (0: no window closes)
            locs = out_loc(pool.req_to_token, token_slots, positions, r)
            kept.append(locs[locs > 0])
        if s.kind == "prefill":
            engine.prefill(s, inputs, timer)
        elif graph is not None:
            graph.replay(s, inputs, timer)
        else:
            engine.decode(s, inputs, timer, phase="capture" if use_graph else "decode")
            if use_graph:   # the first decode step ran eagerly (it also loaded the decode kernels)
                graph = DecodeGraph(engine, s.slots, inputs, config.decode_plans)
        if reference is not None:
            (reference.prefill if s.kind == "prefill" else reference.decode)(s, inputs, ref_timer)
        bar.update(i + 1)
    bar.close()

    phases = []
    for phase, mode in (("prefill", "eager"), ("decode", "cuda graph" if use_graph else "eager")):
        n, total_us, plan_us = timer.totals(phase)
        if n:
            tokens = sum(s.num_tokens for s in steps if s.kind == phase) if phase == "prefill" else n * len(slots)
            if use_graph and phase == "decode" and config.decode_plans == "in-graph":
                plan_us = None
            phases.append(Phase(phase, mode, n, tokens, total_us / n, total_us / (n * config.layers),
                                tokens / (total_us * 1e-6) if total_us > 0 else float("inf"),
                                plan_us / n if plan_us is not None else None))
    if before_check is not None:
        before_check(engine)
    checks = []
    if reference is not None:
        checks = compare_engines(engine, reference, {r: torch.cat(v) for r, v in stored.items()})
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return DemoResult(ok=all(c.ok for c in checks), device=str(dev), device_name=name,
                      backend="kernels" if dev.type == "cuda" else "reference",
                      config=asdict(config), prompt_lens=prompt_lens,
                      layer_kinds=[" + ".join(f"{sp.name} ({sp.store})" for sp in layer) for layer in specs],
                      load_seconds=load_seconds, phases=phases, checks=checks)


def config_for(device: torch.device, **overrides) -> DemoConfig:
    """The defaults of the device kind with the given (non-None) options applied."""
    base = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def format_result(result: DemoResult) -> list[str]:
    cfg = result.config
    backend = ("CUDA kernels" if result.backend == "kernels"
               else "the torch reference backend (CPU tensors; no kernels run)")
    sizes = (f"requests {cfg['requests']} (prompts {min(result.prompt_lens)}-{max(result.prompt_lens)}, "
             f"{sum(result.prompt_lens)} tokens), prefill chunk {cfg['chunk']} tokens, {cfg['decode_steps']} decode "
             f"steps, seed {cfg['seed']}")
    where = f"{result.device_name} ({result.device})" if result.backend == "kernels" else f"the {result.device_name}"
    lines = [f"dsv4jit demo on {where}: {backend}", sizes,
             f"layers {cfg['layers']}: " + "; ".join(dict.fromkeys(result.layer_kinds)) + " (alternating)",
             "compressor step: " + ("one op per layer: compress_and_store_c4_layer (c4), compress_and_store (c128)"
                                    if cfg["fused"]
                                    else "compress_forward + compress_norm_rope_store")]
    loaded = ("the CPU planner" if result.backend == "reference"
              else "the kernels and the CPU planner" if cfg["check"] else "the kernels")
    lines.append(f"first use: {result.load_seconds:.2f} s to load {loaded}, compiling what the cache lacks "
                 "(not in the timings below)")
    clock = "CUDA events" if result.backend == "kernels" else "host clock"
    header = (f"{'phase':8s} {'mode':11s} {'steps':>6s} {'tokens':>8s} {'plan µs':>9s} {'µs/step':>10s} "
              f"{'µs/layer-step':>14s} {'tokens/s':>11s}   ({clock})")
    lines += ["", header]
    for p in result.phases:
        plan = f"{p.plan_us_per_step:9.1f}" if p.plan_us_per_step is not None else f"{'in graph':>9s}"
        lines.append(f"{p.phase:8s} {p.mode:11s} {p.steps:6d} {p.tokens:8d} {plan} {p.us_per_step:10.1f} "
                     f"{p.us_per_layer_step:14.1f} {p.tokens_per_s:11,.0f}")
    if result.backend == "kernels" and any(p.phase == "decode" and p.mode == "cuda graph" for p in result.phases):
        lines.append("decode: the first step runs eagerly before the capture and is not timed")
    lines.append("")
    if not result.checks:
        lines.append("not checked against the reference backend (--no-check)")
        return lines
    what = ("the reference backend (CPU)" if result.backend == "kernels"
            else "a second reference run (no kernels here: this checks the flow, not the kernels)")
    lines.append(f"final states and caches against {what}:")
    for c in result.checks:
        lines.append(f"  layer {c.layer:<3d} {c.compressor:11s} {c.part:5s} {'ok ' if c.ok else 'MISMATCH'}  {c.detail}")
    failed = sum(not c.ok for c in result.checks)
    lines.append("every state and cache matched" if not failed else f"{failed} of {len(result.checks)} checks FAILED")
    return lines
