"""One c4 compressor (the DeepSeek-V4 core latent, head_dim 512) through a prefill step and a decode
step, every input built here. All tensors live on the CPU, so the torch reference backend runs: no
GPU and no CUDA compiler needed (the planner's C++ is compiled for the host on first use).

    python examples/compress_cpu.py

These are the calls a serving stack makes on the GPU (docs/serving.md); with the tensors on a CUDA
device the kernels run instead. The last line checks the result: PASS, or FAIL and exit status 1.
"""

import sys

import torch

from dsv4jit import (CompressorDecodePlan, CompressorPrefillPlan, compress_and_store, compress_forward,
                     compress_norm_rope_store)
from dsv4jit.geometry import page_bytes
from dsv4jit.reference.store import read_cache

gen = torch.Generator().manual_seed(0)

# --- what the serving stack owns ------------------------------------------------------------------
# KV pages of 256 tokens; page 0 is reserved, so cache location 0 (the out_loc of a token that closes
# no window) is never read. Request slot 0 holds pages 1 and 2, request slot 1 pages 3 and 4.
pos = torch.arange(512)
pages = torch.tensor([[1, 2], [3, 4]])
req_to_token = (pages[:, pos // 256] * 256 + pos % 256).to(torch.int32)  # [slots, max_ctx]: full-pool slots
full_to_state = torch.arange(5 * 256) - 256       # full slot -> SWA slot (page aligned): page p -> SWA page p - 1
full_to_state[:256] = -1                          # page 0 has no SWA page
state = torch.zeros(4 * 8, 4 * 512)               # the state ring pool: 8 rows of 4·hd per SWA page
cache = torch.zeros(5, page_bytes("v4_fp8", 64), dtype=torch.uint8)  # one page of 64 compressed tokens per KV page

# --- the layer's weights: ape (the checkpoint's [4, 2·hd] rearranged to [8, hd]), the norm, RoPE ----
ape = 0.5 * torch.randn(8, 512, generator=gen)
w = 0.5 + torch.rand(512, generator=gen)
angles = torch.outer(torch.arange(512.0), 40000.0 ** -(torch.arange(0, 64, 2) / 64))
freqs_cis = torch.polar(torch.ones_like(angles), angles)  # complex64 [max_pos, 32]


def cache_locations(req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """out_loc: a token's compressed-cache location (full slot // 4) when it closes a window, else 0."""
    full = req_to_token[req_slots, positions].to(torch.int64)
    return torch.where((positions + 1) % 4 == 0, full // 4, torch.zeros_like(full))


# --- prefill: request slot 1 with a prompt of 299 tokens, request slot 0 with 131 ------------------
req_pool_indices = torch.tensor([1, 0])
seq_lens = extend_lens = torch.tensor([299, 131])
num_q_tokens = int(extend_lens.sum())
kv_score = torch.randn(num_q_tokens, 4 * 512, generator=gen)  # x @ wkv_gate^T: kv and score, ragged
out_loc = cache_locations(torch.repeat_interleave(req_pool_indices, extend_lens),
                          torch.cat([torch.arange(n) for n in seq_lens.tolist()]))

# once per forward step and ratio, shared by every layer of that ratio
plan = CompressorPrefillPlan.generate(4, req_pool_indices, seq_lens, extend_lens, req_to_token,
                                      full_to_state, swa_page_size=256, ring_size=8,
                                      num_q_tokens=num_q_tokens)
# per layer: pool each compress event's window and update the state ring ...
kv = compress_forward(state.view(-1, 4, 4 * 512), kv_score, ape, plan, head_dim=512, compress_ratio=4)
# ... then RMSNorm + RoPE + quantize into the paged compressed cache
compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=freqs_cis, out_loc=out_loc,
                         kvcache=cache.view(torch.uint8), page_size=64)
print(f"prefill: {num_q_tokens} tokens, {int((out_loc > 0).sum())} compressed tokens stored")

# --- decode: one token per request; compress_and_store does both calls in one op (same bytes) ------
seq_lens = seq_lens + 1
out_loc = cache_locations(req_pool_indices, seq_lens - 1)
plan = CompressorDecodePlan.generate(4, req_pool_indices, req_to_token, full_to_state, seq_lens,
                                     swa_page_size=256, ring_size=8)
kv_score = torch.randn(2, 4 * 512, generator=gen)
state_before, cache_before = state.clone(), cache.clone()  # the same step as two calls, in the check below
compress_and_store(state, kv_score, ape, plan, head_dim=512, compress_ratio=4,
                   norm_weight=w, norm_eps=1e-6, freq_cis=freqs_cis, out_loc=out_loc, kvcache=cache, page_size=64)

# --- read back what request slot 0 holds now: one compressed token per 4 positions ------------------
locs = cache_locations(torch.zeros(132, dtype=torch.int64), torch.arange(132))
rows = read_cache("v4_fp8", cache, locs[locs > 0], 64)
print(f"decode: request slot 0 holds {rows.shape[0]} compressed tokens of {rows.shape[1]} values "
      f"(RMS {float(rows.pow(2).mean().sqrt()):.2f})")

# --- check: the one op and the two calls write the same bytes; each window slot 0 closed is stored --
kv = compress_forward(state_before.view(-1, 4, 4 * 512), kv_score, ape, plan, head_dim=512, compress_ratio=4)
compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=freqs_cis, out_loc=out_loc,
                         kvcache=cache_before, page_size=64)
same = torch.equal(state, state_before) and torch.equal(cache, cache_before)
closed = 132 // 4  # positions 0-131 of request slot 0 close windows at 3, 7, ..., 131
stored = int((rows.abs().sum(dim=1) > 0).sum())  # a token never written reads as zeros
if same and stored == closed:
    print("PASS: compress_and_store wrote what compress_forward and compress_norm_rope_store write, "
          f"and request slot 0 holds all {closed} of its compressed tokens")
else:
    print(f"FAIL: the one op and the two calls wrote {'the same' if same else 'different'} bytes; "
          f"request slot 0 holds {stored} of its {closed} compressed tokens")
    sys.exit(1)
