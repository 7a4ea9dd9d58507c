"""One backend's copy of the model state, and how it runs a forward step.

Per step: one plan per compress ratio (built once, shared by every layer of that ratio), then every
layer's compressors. Prefill plans come from host-resident lengths (the scheduler knows them); decode
plans from device-resident lengths, so the decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import time

import torch

from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from ..reference.store import yarn_freq_cis
from .layer import Compressor, CompressorSpec, layer_step
from .pool import SWA_PAGE, PagedPool, Step, out_loc

#: kv_score inputs of one step: [layer][compressor] -> [tokens, last_dim] fp32 (the wkv_gate GEMM output).
Inputs = list[list[torch.Tensor]]


class Engine:
    def __init__(self, device: torch.device, pool: PagedPool, specs: list[tuple[CompressorSpec, ...]], seed: int,
                 fused: bool = False):
        self.device, self.fused = device, fused
        self.req_to_token = pool.req_to_token.to(device)
        self.full_to_state = pool.full_to_state.to(device)
        self.freq_cis = yarn_freq_cis(pool.max_ctx).to(device)
        gen = torch.Generator().manual_seed(seed)
        self.layers = [[Compressor(spec, pool, gen, device) for spec in layer] for layer in specs]
        self.ring_size = {spec.ratio: spec.ring_size for layer in specs for spec in layer}

    def compressors(self):
        """(layer index, compressor) pairs in a fixed order."""
        return [(i, comp) for i, layer in enumerate(self.layers) for comp in layer]

    # ---- plans and metadata (once per step and ratio) -------------------------------------------
    def prefill_plans(self, s: Step) -> dict[int, CompressorPrefillPlan]:
        slots = torch.tensor(s.slots, dtype=torch.int64, device=self.device)
        seq = torch.tensor(s.seq_lens, dtype=torch.int64)          # lengths stay on the host
        ext = torch.tensor(s.extend_lens, dtype=torch.int64)
        return {r: CompressorPrefillPlan.generate(r, slots, seq, ext, self.req_to_token, self.full_to_state, SWA_PAGE,
                                                  ring, s.num_tokens)
                for r, ring in self.ring_size.items()}

    def decode_plans(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> dict[int, CompressorDecodePlan]:
        return {r: CompressorDecodePlan.generate(r, slots, self.req_to_token, self.full_to_state, seq_lens, SWA_PAGE,
                                                 ring)
                for r, ring in self.ring_size.items()}

    def decode_out_locs(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> dict[int, torch.Tensor]:
        return {r: out_loc(self.req_to_token, slots, seq_lens - 1, r) for r in self.ring_size}

    def prefill_out_locs(self, s: Step) -> dict[int, torch.Tensor]:
        slots, pos = s.token_positions()
        return {r: out_loc(self.req_to_token, slots.to(self.device), pos.to(self.device), r) for r in self.ring_size}

    # ---- layers ---------------------------------------------------------------------------------
    def run_layers(self, plans: dict, inputs: Inputs, out_locs: dict[int, torch.Tensor]) -> None:
        for layer, layer_inputs in zip(self.layers, inputs):
            r = layer[0].spec.ratio
            layer_step(layer, plans[r], layer_inputs, out_locs[r], self.freq_cis, fused=self.fused)

    def to_device(self, inputs: Inputs) -> Inputs:
        return [[x.to(self.device, non_blocking=True) for x in layer] for layer in inputs]

    def prefill(self, s: Step, inputs: Inputs, timer: Timer) -> None:
        inputs, out_locs = self.to_device(inputs), self.prefill_out_locs(s)
        start = timer.mark()
        plans = self.prefill_plans(s)
        planned = timer.mark()
        self.run_layers(plans, inputs, out_locs)
        timer.add("prefill", start, timer.mark(), planned)

    def decode(self, s: Step, inputs: Inputs, timer: Timer, phase: str = "decode") -> None:
        slots = torch.tensor(s.slots, dtype=torch.int64, device=self.device)
        seq = torch.tensor(s.seq_lens, dtype=torch.int64, device=self.device)
        inputs, out_locs = self.to_device(inputs), self.decode_out_locs(slots, seq)
        start = timer.mark()
        plans = self.decode_plans(slots, seq)
        planned = timer.mark()
        self.run_layers(plans, inputs, out_locs)
        timer.add(phase, start, timer.mark(), planned)


class DecodeGraph:
    """The decode step of a fixed batch, captured once and replayed with new lengths and inputs.

    Static buffers hold the lengths and the kv_score inputs. ``plans="in-graph"`` captures the
    planner and the out_loc computation too, so a replay builds the plans from the device-resident
    lengths; ``plans="copy"`` captures only the layers and refreshes static plans before each replay
    with ``plan.copy_`` from plans generated outside the graph.
    """

    def __init__(self, engine: Engine, slots: tuple[int, ...], inputs: Inputs, plans: str = "in-graph"):
        if plans not in ("in-graph", "copy"):
            raise ValueError(f"plans must be 'in-graph' or 'copy', got {plans!r}")
        self.engine, self.mode = engine, plans
        dev = engine.device
        self.slots = torch.tensor(slots, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(len(slots), dtype=torch.int64, device=dev)  # 1: a valid length
        self.inputs = [[torch.zeros_like(x, device=dev) for x in layer] for layer in inputs]
        if plans == "copy":
            self.plans = engine.decode_plans(self.slots, self.seq_lens)
            self.out_locs = engine.decode_out_locs(self.slots, self.seq_lens)
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()

    def _body(self) -> None:
        e = self.engine
        if self.mode == "in-graph":
            plans, out_locs = e.decode_plans(self.slots, self.seq_lens), e.decode_out_locs(self.slots, self.seq_lens)
        else:
            plans, out_locs = self.plans, self.out_locs
        e.run_layers(plans, self.inputs, out_locs)

    def replay(self, s: Step, inputs: Inputs, timer: Timer) -> None:
        e = self.engine
        self.seq_lens.copy_(torch.tensor(s.seq_lens, dtype=torch.int64), non_blocking=True)
        for statics, fresh in zip(self.inputs, inputs):
            for static, x in zip(statics, fresh):
                static.copy_(x, non_blocking=True)
        start = timer.mark()
        if self.mode == "copy":
            for r, plan in e.decode_plans(self.slots, self.seq_lens).items():
                self.plans[r].copy_(plan)
            for r, loc in e.decode_out_locs(self.slots, self.seq_lens).items():
                self.out_locs[r].copy_(loc)
        self.graph.replay()
        timer.add("decode", start, timer.mark())


class Timer:
    """Step times: CUDA events on a GPU (read once at the end), the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list[tuple]] = {}

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, phase: str, start, end, planned: object | None = None) -> None:
        self.spans.setdefault(phase, []).append((start, end, planned))

    def _us(self, a, b) -> float:
        return 1e3 * a.elapsed_time(b) if self.cuda else 1e6 * (b - a)

    def totals(self, phase: str) -> tuple[int, float, float | None]:
        """(steps, total µs, planner µs or None when the plans were built inside a graph)."""
        spans = self.spans.get(phase, [])
        if self.cuda:
            torch.cuda.synchronize()
        total = sum(self._us(a, b) for a, b, _ in spans)
        plan = None
        if spans and all(p is not None for _, _, p in spans):
            plan = sum(self._us(a, p) for a, _, p in spans)
        return len(spans), total, plan
