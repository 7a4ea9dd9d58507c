"""The compressors of two DeepSeek-V4 layers as a serving stack runs them on a GPU: kernels built
ahead of time (warmup), one prefill step with plans from host-resident lengths, then decode steps
replayed from a CUDA graph that builds its plans from device-resident lengths.

    python examples/serving_step.py            # a CUDA GPU: the kernels (compiled on first use)
    python examples/serving_step.py --device cpu

Without a GPU it says so and runs the same steps on the CPU at a small size (the torch reference
backend, no graph). Layer 0 is a c4 layer (the core latent, head_dim 512, V4 fp8 cache, and the
indexer, head_dim 128, fp4 cache); layer 1 a c128 layer (core latent). docs/serving.md explains
each call. The last line checks the run: every state ring (bit for bit) and cache (within one
quantization step on rounding ties, contract §9.6) against the same steps on the reference backend
(on the CPU a second reference run, which checks the flow, not the kernels): PASS, or FAIL and exit
status 1.
"""

import argparse
import sys
import time

import torch

import dsv4jit
from dsv4jit import CompressorDecodePlan, CompressorPrefillPlan, compress_and_store
from dsv4jit.demo.check import compare_cache, compare_state
from dsv4jit.geometry import page_bytes

PAGE = 256                                    # KV page = SWA page (tokens)
RING = {4: 8, 128: 128}                       # state ring rows per SWA page (c4) / request (c128)
# (compress ratio, head_dim, cache format) of each compressor, per layer
LAYERS = [((4, 512, "v4_fp8"), (4, 128, "indexer_fp4")), ((128, 512, "v4_fp8"),)]


class Compressor:
    """One compressor of one layer: weights, state ring pool and compressed cache."""

    def __init__(self, ratio, head_dim, fmt, num_slots, num_pages, device, gen):
        self.ratio, self.head_dim, self.fmt = ratio, head_dim, fmt
        self.width = (4 if ratio == 4 else 2) * head_dim       # kv and score (c4: two overlapping halves)
        rings = num_pages if ratio == 4 else num_slots          # c4: a ring per SWA page; c128: per request
        self.state = torch.zeros(rings * RING[ratio], self.width, device=device)
        self.cache = torch.zeros(num_pages, page_bytes(fmt, PAGE // ratio), dtype=torch.uint8, device=device)
        self.ape = (0.5 * torch.randn(8 if ratio == 4 else 128, head_dim, generator=gen)).to(device)
        self.norm_weight = (0.5 + torch.rand(head_dim, generator=gen)).to(device)

    def step(self, plan, kv_score, out_loc, freq_cis):
        compress_and_store(self.state, kv_score, self.ape, plan, head_dim=self.head_dim, compress_ratio=self.ratio,
                           norm_weight=self.norm_weight, norm_eps=1e-6, freq_cis=freq_cis, out_loc=out_loc,
                           kvcache=self.cache, page_size=PAGE // self.ratio, use_fp4=self.fmt == "indexer_fp4")


def pool(requests, max_ctx, device):
    """req_to_token, full_to_state and the number of KV pages: request slot i owns its pages; page 0
    is reserved (out_loc 0 = "closes no window")."""
    pages_per_req = -(-max_ctx // PAGE)
    num_pages = 1 + requests * pages_per_req
    pos = torch.arange(max_ctx)
    owned = 1 + torch.arange(requests * pages_per_req).reshape(requests, pages_per_req)
    req_to_token = (owned[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32).to(device)
    full_to_state = torch.arange(num_pages * PAGE, device=device)   # one SWA page per KV page, same offsets
    return req_to_token, full_to_state, num_pages


def out_locs(req_to_token, req_slots, positions):
    """Per ratio and token: its compressed-cache location if it closes a window, else 0 (torch ops, so
    they run inside a CUDA graph too)."""
    full = req_to_token[req_slots, positions].to(torch.int64)
    return {r: torch.where((positions + 1) % r == 0, full // r, torch.zeros_like(full)) for r in RING}


def run_steps(device, requests, prompt, decode_steps, say):
    """Warmup, a prefill step and the decode steps on `device`, from seeded inputs; returns the layers'
    compressors. `say` prints what happened."""
    gen = torch.Generator().manual_seed(0)

    # Build and load every kernel this configuration reaches, before any capture.
    loaded = dsv4jit.warmup(device, ops=("plan", "fused"), use_fp4=True)
    say(f"warmup: {len(loaded)} variant{'' if len(loaded) == 1 else 's'} loaded")

    max_ctx = prompt + decode_steps
    req_to_token, full_to_state, num_pages = pool(requests, max_ctx, device)
    layers = [[Compressor(*spec, requests, num_pages, device, gen) for spec in layer] for layer in LAYERS]
    angles = torch.outer(torch.arange(max_ctx + 1.0), 40000.0 ** -(torch.arange(0, 64, 2) / 64))
    freq_cis = torch.polar(torch.ones_like(angles), angles).to(device)

    def run_layers(plans, inputs, locs):
        for layer, layer_inputs in zip(layers, inputs):
            for comp, kv_score in zip(layer, layer_inputs):
                comp.step(plans[comp.ratio], kv_score, locs[comp.ratio], freq_cis)

    def kv_scores(tokens):  # stand-ins for the wkv_gate projection of each compressor
        return [[torch.randn(tokens, c.width, generator=gen).to(device) for c in layer] for layer in layers]

    slots = torch.arange(requests, device=device)

    # Prefill: the whole prompts in one step; lengths on the host (the scheduler has them).
    seq_lens = torch.full((requests,), prompt)
    tokens = requests * prompt
    inputs = kv_scores(tokens)
    locs = out_locs(req_to_token, torch.repeat_interleave(slots, prompt),
                    torch.arange(prompt, device=device).repeat(requests))
    start = time.perf_counter()
    plans = {r: CompressorPrefillPlan.generate(r, slots, seq_lens, seq_lens, req_to_token, full_to_state, PAGE,
                                               ring, tokens) for r, ring in RING.items()}
    run_layers(plans, inputs, locs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    say(f"prefill: {tokens} tokens in {1e3 * (time.perf_counter() - start):.1f} ms (plans included)")

    # Decode: static buffers for what changes per step; plans and out_loc built inside the step.
    static_seq = seq_lens.to(device) + 1
    static_inputs = kv_scores(requests)

    def decode_step():
        plans = {r: CompressorDecodePlan.generate(r, slots, req_to_token, full_to_state, static_seq, PAGE, ring)
                 for r, ring in RING.items()}
        run_layers(plans, static_inputs, out_locs(req_to_token, slots, static_seq - 1))

    decode_step()                                # one eager step before capture
    replay = decode_step
    if device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_step()
        replay = graph.replay
    start = time.perf_counter()
    for _ in range(decode_steps - 1):
        static_seq += 1                          # in place: the graph reads this buffer
        for statics, fresh in zip(static_inputs, kv_scores(requests)):
            for static, x in zip(statics, fresh):
                static.copy_(x)
        replay()
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = 1e6 * (time.perf_counter() - start) / (decode_steps - 1)
    say(f"decode: {decode_steps} steps of {requests} requests, {per_step:.1f} µs per step "
        f"({'CUDA graph' if device.type == 'cuda' else 'eager'}; input copies included)")
    return layers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        print("no CUDA GPU in use: the torch reference backend runs these steps at a small size")
    requests, prompt, decode_steps = (8, 2000, 64) if device.type == "cuda" else (2, 300, 4)
    got = run_steps(device, requests, prompt, decode_steps, say=print)
    want = run_steps(torch.device("cpu"), requests, prompt, decode_steps, say=lambda text: None)

    # --- check: the final state rings and caches against the reference run's
    max_ctx = prompt + decode_steps              # every position of every request has been through a step
    req_to_token, _, _ = pool(requests, max_ctx, "cpu")
    every_token = out_locs(req_to_token, torch.arange(requests).repeat_interleave(max_ctx),
                           torch.arange(max_ctx).repeat(requests))
    stored = {r: locs[locs > 0] for r, locs in every_token.items()}
    failed = []
    for index, (layer, reference) in enumerate(zip(got, want)):
        for comp, ref in zip(layer, reference):
            for part, (ok, detail) in (("state", compare_state(comp.state, ref.state)),
                                       ("cache", compare_cache(comp.fmt, PAGE // comp.ratio, comp.cache, ref.cache,
                                                               stored[comp.ratio]))):
                if not ok:
                    failed.append(f"layer {index} c{comp.ratio} {comp.fmt} {part}: {detail}")
    checked = sum(map(len, got))
    against = "the reference backend" if device.type == "cuda" else "a second run on the reference backend"
    if failed:
        print(f"FAIL: {len(failed)} of {2 * checked} checks against {against}: {'; '.join(failed)}")
        sys.exit(1)
    print(f"PASS: every state and cache matches {against} ({checked} compressors)")


if __name__ == "__main__":
    main()
