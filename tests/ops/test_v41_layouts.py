"""The DeepSeek-V4.1 layouts and the two-pool V4 store through compress_norm_rope_store,
compress_and_store and compress_and_store_c4_layer (contract §10.3): each op on the GPU against the same
op on the CPU (the torch references) on the same step, caches starting as the same random bytes; and
the V4.1 codes of the kernels against the reference rules on every fp32 bit pattern (contract §10.2).

The store step's fp32 RMSNorm sum runs in the kernels' canonical order and in fp64 in the reference
(contract §10.7), so a code may flip on a rounding boundary: at most FLIPS of a cache's bytes may
differ; states are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

import dsv4jit
from dsv4jit import compress_and_store, compress_and_store_c4_layer, compress_forward, compress_norm_rope_store, runtime
from dsv4jit.geometry import ROPE_ROW_BYTES, V41_FORMATS, page_bytes
from dsv4jit.reference.quant_v41 import e2m1rn_encode, v41_fp4_scale, v41_tile_exponent
from dsv4jit.reference.quant import e4m3_encode
from helpers.compressor_step import EPS, PAGE_SIZE, make_step

HAS_CUDA = torch.cuda.is_available()
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
FLIPS = 5e-3
#: (layout, fp8_2buff) of the cases: every V4.1 layout and the two pools.
STORES = [(layout, False) for layout in V41_FORMATS] + [("v4", True)]


def fmt_of(layout: str, two_pools: bool) -> str:
    return "v4_fp8_2buff" if two_pools else layout


def caches(step, layout: str, two_pools: bool, seed: int) -> dict:
    """The step's cache in the layout (and the rope pool of the two pools), random bytes."""
    g = torch.Generator().manual_seed(seed)
    page = PAGE_SIZE[step.ratio]
    pages = step.kvcache.shape[0]
    out = {"kvcache": torch.randint(0, 256, (pages, page_bytes(fmt_of(layout, two_pools), page)), generator=g,
                                    dtype=torch.uint8)}
    out["kvcache_rope"] = (torch.randint(0, 256, (pages * page, ROPE_ROW_BYTES), generator=g, dtype=torch.uint8)
                           if two_pools else None)
    return out


def options(layout: str, two_pools: bool, pools: dict) -> dict:
    return dict(layout=layout, fp8_2buff=two_pools, kvcache=pools["kvcache"], kvcache_rope=pools["kvcache_rope"])


def assert_flips(what: str, got: torch.Tensor, expect: torch.Tensor) -> None:
    differ = int((got.cpu() != expect.cpu()).sum())
    assert differ <= FLIPS * got.numel(), f"{what}: {differ} of {got.numel()} bytes differ"


def on(device, tensors: dict) -> dict:
    return {k: (v.clone().to(device) if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}


def check_step(layout: str, two_pools: bool, ratio: int, decode: bool, op: str, batch: int = 3) -> None:
    """One step of `op` (the store after compress_forward, or the fused op) on the CPU and on the GPU:
    identical states, caches within FLIPS."""
    results = []
    for dev in ("cpu", "cuda"):
        step = make_step(dev, ratio=ratio, decode=decode, seed=11 + ratio, batch=batch)
        pools = on(dev, caches(step, layout, two_pools, seed=5))
        if op == "store":
            kv = compress_forward(step.state, step.x, step.ape, step.plan, head_dim=512, compress_ratio=ratio)
            compress_norm_rope_store(kv, step.plan, norm_weight=step.weight, norm_eps=EPS, freq_cis=step.freq_cis,
                                     out_loc=step.out_loc, page_size=PAGE_SIZE[ratio],
                                     **options(layout, two_pools, pools))
        else:
            compress_and_store(step.state, step.x, step.ape, step.plan, head_dim=512, compress_ratio=ratio,
                               norm_weight=step.weight, norm_eps=EPS, freq_cis=step.freq_cis, out_loc=step.out_loc,
                               page_size=PAGE_SIZE[ratio], **options(layout, two_pools, pools))
        results.append((step.state.cpu(), pools))
    (state_ref, ref), (state_dev, dev) = results
    assert torch.equal(state_dev, state_ref), "states differ"
    for name in ("kvcache", "kvcache_rope"):
        if ref[name] is not None:
            assert_flips(name, dev[name], ref[name])


@pytest.mark.parametrize("layout,two_pools", STORES)
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("op", ["store", "fused"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_latent_layouts_match_the_reference(layout, two_pools, ratio, decode, op, device):
    check_step(layout, two_pools, ratio, decode, op)


@pytest.mark.parametrize("layout", ["v41_fp4", "v41_fp4_new"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_fp4_layouts_store_large_batches_a_row_per_warp(layout, device):
    """The fp4 layouts' store takes a block of 4 warps per row up to 1024 rows (the batches above) and a
    warp per row beyond: a decode step of 1025 requests."""
    check_step(layout, False, 4, True, "store", batch=1025)


@pytest.mark.parametrize("layout,two_pools", STORES)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_the_c4_layer_op_stores_its_core_in_the_layout(layout, two_pools, decode, device):
    results = []
    for dev in ("cpu", "cuda"):
        core = make_step(dev, ratio=4, decode=decode, seed=21)
        indexer = make_step(dev, ratio=4, head_dim=128, decode=decode, seed=21, use_fp4=True)
        pools = on(dev, caches(core, layout, two_pools, seed=6))
        compress_and_store_c4_layer(core.state, core.x, core.ape, indexer.state, indexer.x, indexer.ape, core.plan,
                                    norm_weight=core.weight, indexer_norm_weight=indexer.weight, norm_eps=EPS,
                                    freq_cis=core.freq_cis, out_loc=core.out_loc, page_size=PAGE_SIZE[4],
                                    indexer_kvcache=indexer.kvcache, use_fp4=True, **options(layout, two_pools, pools))
        results.append((core.state.cpu(), indexer.state.cpu(), indexer.kvcache.cpu(), pools))
    (core_ref, idx_ref, idx_cache_ref, ref), (core_dev, idx_dev, idx_cache_dev, dev) = results
    assert torch.equal(core_dev, core_ref) and torch.equal(idx_dev, idx_ref), "states differ"
    assert_flips("indexer cache", idx_cache_dev, idx_cache_ref)
    for name in ("kvcache", "kvcache_rope"):
        if ref[name] is not None:
            assert_flips(name, dev[name], ref[name])


def fp32_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values of unsigned 32-bit patterns held in int64."""
    return (bits - (1 << 32) * (bits >= 1 << 31)).to(torch.int32).view(torch.float32)


def quotient_probe_inputs(seed: int) -> list[torch.Tensor]:
    """Bit patterns (int64) of a quotient probe's x: every significand of [1, 2), both signs, the binades
    at the fast range's bounds 2^-60 and 2^60, 2^24 random patterns and zeros, a subnormal, ±inf, NaN
    and the largest finite value."""
    binade = 1 << 23
    starts = [0x3F800000, 0xBF800000, 0x21000000, 0x21800000, 0x5D000000, 0x5D800000]  # [1, 2), 2^-61.., 2^59..
    random = torch.randint(-(1 << 31), 1 << 31, (1 << 24,), generator=torch.Generator().manual_seed(seed))
    specials = torch.tensor([0, 1 << 31, 1, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F7FFFFF], dtype=torch.int64)
    return [torch.arange(start, start + binade, dtype=torch.int64) for start in starts] + [random, specials]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_v41_codes_equal_the_reference_rules_on_every_fp32(device):
    """The kernels' V4.1 codes (the store_probes module) against reference.quant_v41 on all 2^32 fp32 bit
    patterns: e2m1 with ties to even (in software on sm_90a) with -0, subnormals, saturation, ±inf and
    NaN (-> 0x7); for |x| as a tile's largest magnitude, the v41 tile exponent, the v41_fp4 scale code
    and the fake quant's scale code (e4m3(clamp(|x| · fl(1/6), 2^-9, 448)))."""
    dev = torch.device(device, torch.cuda.current_device())
    codes = runtime.function("store_probes", "v41_codes", dev)
    chunk = 1 << 27
    out = torch.full((chunk, 4), -1, dtype=torch.int32, device=dev)
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=dev)
        x = fp32_of_bits(bits)
        codes(x, out)
        code = e2m1rn_encode(x).to(torch.int32)
        amax = x.abs()
        expected = {"e2m1": code | code << 4, "v41 exponent": v41_tile_exponent(amax).to(torch.int32),
                    "v41_fp4 scale": v41_fp4_scale(amax)[0].to(torch.int32),
                    "fake quant scale": e4m3_encode((amax * (1.0 / 6.0)).clamp(2.0 ** -9, 448.0)).to(torch.int32)}
        for col, (what, want) in enumerate(expected.items()):
            finite = ~amax.isnan() if col else torch.ones_like(amax, dtype=torch.bool)  # a NaN amax has no tile
            bad = ((out[:, col] != want) & finite).nonzero()
            assert bad.numel() == 0, (f"{what}: {bad.numel()} differ from {start:#010x} on, first at bit pattern "
                                      f"{start + int(bad[0]):#010x}: {int(out[bad[0], col])} != {int(want[bad[0]])}")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_fp4_quotients_by_a_tile_scale_are_ieee_divisions(device):
    """The fp4 codecs divide by a tile scale without a division (a reciprocal product corrected by one
    remainder step: short_quotients). For every positive e4m3 divisor (2^-9 to 448, 6 among them) the
    quotients equal __fdiv_rn's bit for bit: on every fp32 significand of x, both signs (in the range
    the products take, scaling x by 2^k scales every step exactly), on the binades at the range's
    bounds 2^-60 and 2^60, and on 2^24 random bit patterns (zeros, subnormals, inf, NaN); and the
    branch-free reciprocals equal __frcp_rn on all 126."""
    dev = torch.device(device, torch.cuda.current_device())
    quotients = runtime.function("store_probes", "short_quotients", dev)
    for bits in quotient_probe_inputs(5):
        x = fp32_of_bits(bits).to(dev)
        out = torch.full((x.numel(), 3), -2, dtype=torch.int32, device=dev)
        quotients(x, out)
        bad = (out[:, 0] != 0).nonzero()
        assert bad.numel() == 0, (f"{bad.numel()} values from {int(bits[0]):#010x} on have quotients other than "
                                  f"__fdiv_rn's, first x = {float(x[bad[0]])} by e4m3 code {int(out[bad[0], 1])}")
        assert int(out[:, 2].max()) == 0, "an e4m3 reciprocal differs from __frcp_rn"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_pair_pooling_exp_is_fp64_exp_rounded_on_every_nonpositive_fp32(device):
    """The ratio-2 poolings' branch-free exp (exp_nonpositive) equals (float)exp((double)x), bit for bit,
    on all 2^31 bit patterns with the sign set (-0, subnormals, -inf, NaN) and on +0 and +NaN."""
    dev = torch.device(device, torch.cuda.current_device())
    probe = runtime.function("store_probes", "exp_nonpositive", dev)
    chunk = 1 << 27
    chunks = [(start, chunk) for start in range(1 << 31, 1 << 32, chunk)] + [(0, 1), (0x7FC00000, 1)]
    out = torch.full((chunk, 1), -1, dtype=torch.int32, device=dev)
    for start, n in chunks:
        bits = torch.arange(start, start + n, dtype=torch.int64, device=dev)
        x = fp32_of_bits(bits)
        probe(x, out[:n])
        bad = (out[:n, 0] != 1).nonzero()
        assert bad.numel() == 0, (f"{bad.numel()} values from {start:#010x} on differ from fp64 exp rounded, first "
                                  f"at bit pattern {start + int(bad[0]):#010x}")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_pair_pooling_quotients_are_ieee_divisions(device):
    """The ratio-2 poolings divide by 1 + e (or e_o + e_n) in [1, 2] on __fdiv_rn's fast path with one
    branch for 4 values (unit_quotients): against __fdiv_rn, bit for bit, by 128 divisors (1, 2, their
    neighbours, 124 spread over the binade) on every fp32 significand of x, both signs, on the binades
    at the fast range's bounds 2^-60 and 2^60, and on 2^24 random bit patterns (zeros, subnormals, inf,
    NaN)."""
    dev = torch.device(device, torch.cuda.current_device())
    probe = runtime.function("store_probes", "unit_quotients", dev)
    for bits in quotient_probe_inputs(6):
        x = fp32_of_bits(bits).to(dev)
        out = torch.full((x.numel(), 2), -2, dtype=torch.int32, device=dev)
        probe(x, out)
        bad = (out[:, 0] != 0).nonzero()
        assert bad.numel() == 0, (f"{bad.numel()} values from {int(bits[0]):#010x} on have quotients other than "
                                  f"__fdiv_rn's, first x = {float(x[bad[0]])} by divisor {int(out[bad[0], 1])}")


def test_the_public_names_are_sglangs():
    assert dsv4jit.KVLayout.parse("V41_fp4") is dsv4jit.KVLayout.V41_FP4
    assert dsv4jit.is_valid_kv_layout_pair("v41", "v41_fp4") and not dsv4jit.is_valid_kv_layout_pair("v41", "v41_fp4_new")
