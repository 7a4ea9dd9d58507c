"""compress_norm_rope_store through the public API: contract §6, with contract §2.4, contract §8.4,
contract §9.2 and contract §9.6.

Every test runs on "cpu" (the torch reference backend; also exercises the test logic) and on "cuda"
(the kernel; skipped without a GPU), except the few that only make sense with a GPU.

Expected bytes: the torch reference (``dsv4jit.reference.store``, validated on its own by
tests/reference/test_reference_store.py) run on CPU copies of the same inputs into an identically
poisoned cache. The device cache is compared with it (on "cpu" the public op is that reference, so
there the poison and fp64 checks alone apply: ``reference_for``):

* bytes outside the spans contract §6.5 gives each stored token (other slots, skipped / invalid rows, V4
  scale byte 7, V4 page padding) keep the 0xAB poison, in both caches;
* scale bytes (V4 UE8M0, fp4 UE8M0) are identical on >= 99.9 % of tiles; a differing tile must
  differ by one exponent and its fp64 amax must sit at the power-of-two boundary between them;
* e4m3 / fp4 codes and bf16 values (V4 rope part, bf16_store rows) are identical except on
  <= 0.1 % (fp4: 0.5 %) of elements, each off by one code step / one bf16 ulp — the kernel's fp32
  normed values may differ from the reference's by about an ulp (warp-order RMSNorm reduction,
  fp32 Hadamard butterfly), which can flip a value sitting on a rounding boundary (contract §9.6);
* the indexer fp8 fp32 scale agrees to a relative 2^-20 (see INDEXER_FP8_SCALE_RTOL);
* the dequantized device values (``reference.store.read_cache``) are within the quantization error
  bound of an fp64 evaluation of RMSNorm + RoPE (+ Hadamard) written here from contract §6.2 to contract §6.4.

Plans are built directly (plan_layout encoders) so that they contain invalid rows (both the sentinel
and rows invalid by seq_len alone, contract §2.2), decode rows off a compress boundary with garbage in
write_loc (bytes 4-7 are no ragged id, contract §2.4), ragged ids in random order (out_loc is indexed by
ragged id in prefill, by row in decode, contract §6.1), and out_loc entries of skipped rows that point at
real, unused slots (so a wrong store shows up in the poison check). One test uses the real planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import dsv4jit
from dsv4jit import CompressorDecodePlan, CompressorPrefillPlan, compress_norm_rope_store, runtime
from dsv4jit.geometry import page_bytes
from dsv4jit.plan_layout import (
    INVALID_U32,
    decode_compress_plan,
    encode_compress_plan,
    encode_decode_plan,
    encode_write_plan,
    invalid_compress_rows,
)
from dsv4jit.reference import store as ref_store
from dsv4jit.reference.quant import fp4_encode, ue8m0_exponent
from helpers.pool_utils import SWA_PAGE, random_batch, random_pool

POISON = 0xAB
EPS = 1e-6
HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
CUDA_ONLY = [pytest.param("cuda", marks=CUDA_MARKS)]

#: The kernel's fp32 pipeline vs the reference (fp64 sum of squares and rsqrt, fp64 Hadamard rounded
#: once): the normed values differ by ~1 ulp, the 7-stage fp32 butterfly adds a few ulps of the
#: largest output. An emulation of the kernel's arithmetic on 40 000 random rows gave a largest
#: scale difference of 2^-21.5 (0.8 % of rows above 2^-22), hence 2^-20.
INDEXER_FP8_SCALE_RTOL = 2.0 ** -20
CODE_FLIP_FRACTION = 1e-3      # e4m3 codes and bf16 values
FP4_FLIP_FRACTION = 5e-3
SCALE_FLIP_FRACTION = 1e-3     # UE8M0 tiles


# ----------------------------------------------------------------------------------- formats

@dataclass(frozen=True)
class Fmt:
    name: str          # store format (geometry.FORMATS)
    head_dim: int
    ratio: int
    page_size: int
    num_pages: int
    use_fp4: bool = False
    bf16_store: bool = False

    @property
    def flags(self) -> dict:
        return {"use_fp4": self.use_fp4, "bf16_store": self.bf16_store}

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.name, self.page_size)

    @property
    def id(self) -> str:
        return f"{self.name}-R{self.ratio}-ps{self.page_size}"


V4_C4 = Fmt("v4_fp8", 512, 4, 64, 3)
V4_C128 = Fmt("v4_fp8", 512, 128, 2, 48)
V4_BF16 = Fmt("v4_bf16", 512, 128, 1, 96, bf16_store=True)
IDX_FP8 = Fmt("indexer_fp8", 128, 4, 64, 3)
IDX_FP4 = Fmt("indexer_fp4", 128, 4, 64, 3, use_fp4=True)
FORMATS = [V4_C4, V4_C128, V4_BF16, IDX_FP8, IDX_FP4]

#: Bytes one token owns in its page (contract §6.5), as (offset from the page start, length).
def token_spans(fmt: Fmt, slot: int) -> list[tuple[int, int]]:
    ps = fmt.page_size
    if fmt.name == "v4_fp8":   # 576 data bytes; 7 of the 8 scale bytes (byte 7 is padding, never written)
        return [(slot * 576, 576), (ps * 576 + slot * 8, 7)]
    if fmt.name == "v4_bf16":
        return [(slot * 1024, 1024)]
    if fmt.name == "indexer_fp8":
        return [(slot * 128, 128), (ps * 128 + slot * 4, 4)]
    if fmt.name == "indexer_fp4":
        return [(slot * 64, 64), (ps * 64 + slot * 4, 4)]
    raise AssertionError(fmt.name)


OWNED_BYTES = {"v4_fp8": 583, "v4_bf16": 1024, "indexer_fp8": 132, "indexer_fp4": 68}


def owned_mask(fmt: Fmt, locs: list[int], shape) -> torch.Tensor:
    owned = torch.zeros(shape, dtype=torch.bool)
    for loc in locs:
        page, slot = divmod(loc, fmt.page_size)
        for start, length in token_spans(fmt, slot):
            assert start + length <= fmt.page_bytes
            owned[page, start:start + length] = True
    # distinct locations own disjoint spans
    assert int(owned.sum()) == OWNED_BYTES[fmt.name] * len(locs)
    return owned


def poisoned(fmt: Fmt, num_pages: int | None = None) -> torch.Tensor:
    return torch.full((num_pages or fmt.num_pages, fmt.page_bytes), POISON, dtype=torch.uint8)


# ------------------------------------------------------------------------------------ inputs

@dataclass
class Case:
    fmt: Fmt
    kv: torch.Tensor            # [N, hd] fp32 / bf16 (CPU)
    weight: torch.Tensor        # [hd] fp32 (CPU); the op casts it to kv's dtype
    freq_cis: torch.Tensor      # complex64 [max_pos, 32] (CPU)
    plan: object                # CompressorPrefillPlan / CompressorDecodePlan (any device)
    out_loc: torch.Tensor       # int32 / int64 (CPU)
    rows: list[int] = field(default_factory=list)        # kv rows that store a token
    locs: list[int] = field(default_factory=list)        # their cache locations
    positions: list[int] = field(default_factory=list)   # their RoPE positions (seq_len - R)

    @property
    def decode(self) -> bool:
        return self.plan.is_decode


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_freq_cis(max_pos: int, g: torch.Generator) -> torch.Tensor:
    """Unit rotations with independent random angles for every (position, pair)."""
    angles = (torch.rand(max_pos, 32, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def random_rows(n: int, hd: int, g: torch.Generator) -> torch.Tensor:
    """randn rows with per-row scales 10^U(-3, 2) (tiny rows exercise eps); one row has an outlier."""
    scale = 10.0 ** (torch.rand(n, generator=g) * 5 - 3)
    kv = torch.randn(n, hd, generator=g) * scale[:, None]
    if n > 5:
        kv[5, 7] *= 3e4   # the rest of its V4 tile quantizes to subnormal e4m3 codes
    return kv


def random_weight(hd: int, g: torch.Generator) -> torch.Tensor:
    w = 0.5 + torch.rand(hd, generator=g)
    if hd == 512:
        w[64:128] = 1e-7 * (1 + torch.rand(64, generator=g))   # nope tile 1 falls below the 1e-4 amax floor
    return w


ROWS = 40


def make_case(fmt: Fmt, kv_dtype: torch.dtype, decode: bool, loc_dtype: torch.dtype, seed: int,
              rows: int = ROWS) -> Case:
    """A directly built plan with stored rows, skipped rows and decoy out_loc entries (see module doc)."""
    g = gen(seed)
    R, n = fmt.ratio, rows
    slots = fmt.num_pages * fmt.page_size
    assert slots >= n + 8
    # Slot 0 is never a target: out_loc entries of tokens without an event are 0 (contract §6.1).
    perm = torch.randperm(slots - 1, generator=g) + 1
    targets = perm[:n]
    decoys = torch.cat([torch.zeros(1, dtype=torch.int64), perm[n:]])
    kmax = 24 if R == 128 else 300
    k = torch.randint(1, kmax + 1, (n,), generator=g)
    k[0], k[1] = 1, kmax                                # position 0 and the table's last row
    seq_len = R * k
    if decode:
        boundary = torch.rand(n, generator=g) < 0.65
        boundary[:2], boundary[2:4] = True, False
        offset = torch.randint(1, R, (n,), generator=g)
        seq_len = torch.where(boundary, seq_len, seq_len - offset)
        seq_len[3] = int(torch.randint(1, R, (1,), generator=g))      # still inside its first block
        write_loc = torch.randint(0, 1 << 20, (n,), generator=g)     # bytes 4-7: not a ragged id
        rp0 = torch.randint(-1, 1 << 16, (n,), generator=g)
        rp1 = torch.randint(-1, 1 << 16, (n,), generator=g)
        plan = CompressorDecodePlan(R, encode_decode_plan(seq_len, write_loc, rp0, rp1))
        out_loc = decoys[torch.randint(len(decoys), (n,), generator=g)]
        out_loc[2] = 0
        out_loc[boundary] = targets[boundary]
        stored = boundary.nonzero().flatten()
        locs = out_loc[stored]
    else:
        num_q = 3 * n + 7
        valid = torch.rand(n, generator=g) < 0.7
        valid[:2], valid[2:4] = True, False
        ragged = torch.randperm(num_q, generator=g)[:n]
        last = (ragged == num_q - 1).nonzero().flatten()
        if last.numel():
            j = int(last[0])
            ragged[0], ragged[j] = int(ragged[j]), int(ragged[0])
        else:
            ragged[0] = num_q - 1                                       # out_loc's last entry is read
        buffer_len = torch.randint(0, R + 1, (n,), generator=g)
        rp0 = torch.randint(-1, 1000, (n,), generator=g)
        rp1 = torch.randint(-1, 1000, (n,), generator=g)
        plan_c = encode_compress_plan(seq_len, ragged, buffer_len, rp0, rp1)
        invalid = (~valid).nonzero().flatten()
        sentinel, by_seq_len = invalid[0::2], invalid[1::2]
        plan_c[sentinel] = invalid_compress_rows(len(sentinel))
        # invalid through seq_len == 0xFFFFFFFF alone; the other fields look like a real row (contract §2.2)
        plan_c[by_seq_len] = encode_compress_plan(torch.full((len(by_seq_len),), INVALID_U32), ragged[by_seq_len],
                                                  buffer_len[by_seq_len], rp0[by_seq_len], rp1[by_seq_len])
        plan_w = encode_write_plan(torch.arange(num_q), torch.randint(0, 1 << 16, (num_q,), generator=g))
        plan = CompressorPrefillPlan(R, plan_c, plan_w, None, num_q)
        out_loc = decoys[torch.randint(len(decoys), (num_q,), generator=g)]
        out_loc[ragged[valid]] = targets[valid]
        stored = valid.nonzero().flatten()
        locs = targets[stored]
    positions = (seq_len[stored] - R).tolist()
    max_pos = max(positions) + 1                      # the last stored position uses the table's last row
    hd = fmt.head_dim
    # original=256: a table this short is YaRN-scaled too (kept and divided frequencies, as a long context has)
    freq_cis = (ref_store.yarn_freq_cis(max_pos, theta=40000.0, original=256) if kv_dtype == torch.bfloat16
                else random_freq_cis(max_pos, g))
    case = Case(fmt, random_rows(n, hd, g).to(kv_dtype), random_weight(hd, g), freq_cis, plan,
                out_loc.to(loc_dtype), stored.tolist(), locs.tolist(), positions)
    assert len(set(case.locs)) == len(case.locs)
    if n >= ROWS:  # the main matrix: enough stored rows, over several pages
        assert len(case.locs) >= 8 and len({loc // fmt.page_size for loc in case.locs}) >= 2
    return case


def plan_to(plan, device):
    if plan.is_decode:
        return CompressorDecodePlan(plan.compress_ratio, plan.plan_d.to(device))
    return CompressorPrefillPlan(plan.compress_ratio, plan.plan_c.to(device), plan.plan_w.to(device), None,
                                 plan.num_q_tokens)


def op_kwargs(case: Case, device, kvcache: torch.Tensor) -> dict:
    dev = torch.device(device)
    return dict(norm_weight=case.weight.to(dev), norm_eps=EPS, freq_cis=case.freq_cis.to(dev),
                out_loc=case.out_loc.to(dev), kvcache=kvcache, page_size=case.fmt.page_size, **case.fmt.flags)


def run_public(case: Case, device, kvcache: torch.Tensor | None = None) -> torch.Tensor:
    """The public op on ``device`` into a poisoned cache (or ``kvcache``); returns the cache on the CPU."""
    dev = torch.device(device)
    cache = poisoned(case.fmt).to(dev) if kvcache is None else kvcache
    compress_norm_rope_store(case.kv.to(dev), plan_to(case.plan, dev), **op_kwargs(case, dev, cache))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return cache.cpu()


def run_reference(case: Case, plan_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Expected cache: the torch reference on CPU copies, into a poisoned cache."""
    cache = poisoned(case.fmt)
    ref_store.compress_norm_rope_store(
        case.kv.cpu(), (case.plan[1] if plan_rows is None else plan_rows).cpu(), is_decode=case.decode,
        compress_ratio=case.fmt.ratio, norm_weight=case.weight.cpu(), norm_eps=EPS, freq_cis=case.freq_cis.cpu(),
        out_loc=case.out_loc.cpu(), kvcache=cache, page_size=case.fmt.page_size, **case.fmt.flags)
    return cache


def reference_for(case: Case, device) -> torch.Tensor | None:
    """The reference's cache to hold a kernel's against; None on "cpu", whose backend is the reference
    itself: comparing the two would prove nothing, so there the poison and fp64 oracle checks alone
    judge it."""
    return None if torch.device(device).type == "cpu" else run_reference(case)


# ----------------------------------------------------------------------------- fp64 oracle

def sylvester(n: int = 128) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def oracle(case: Case) -> torch.Tensor:
    """fp64 RMSNorm (contract §6.2) + RoPE at seq_len - R on the trailing 64 interleaved dims (contract §6.3)
    (+ scaled Sylvester Hadamard for hd 128, contract §6.4) of the stored rows, in ``case.locs`` order."""
    hd = case.fmt.head_dim
    x = case.kv.cpu()[case.rows].to(torch.float64)
    w = case.weight.cpu().to(case.kv.dtype).to(torch.float64)      # the op casts the weight to kv's dtype
    eps = float(torch.tensor(EPS, dtype=torch.float32))
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    rot = case.freq_cis.cpu()[torch.tensor(case.positions, dtype=torch.int64)].to(torch.complex128)
    base = hd - 64
    z = torch.complex(y[:, base::2], y[:, base + 1::2]) * rot
    y[:, base::2], y[:, base + 1::2] = z.real, z.imag
    if hd == 128:
        y = y @ sylvester(128) / math.sqrt(128)
    return y


# ------------------------------------------------------------------------- parsing the bytes

def gather(fmt: Fmt, cache: torch.Tensor, locs: list[int], span: int) -> torch.Tensor:
    """uint8 [n, length] of span ``span`` (index into token_spans) of each location."""
    out = []
    for loc in locs:
        page, slot = divmod(loc, fmt.page_size)
        start, length = token_spans(fmt, slot)[span]
        out.append(cache[page, start:start + length])
    return torch.stack(out).contiguous()


def parse(fmt: Fmt, cache: torch.Tensor, locs: list[int]) -> dict:
    """The fields of each stored token, read from the raw bytes per contract §6.5."""
    if fmt.name == "v4_fp8":
        data = gather(fmt, cache, locs, 0)
        return {"codes": data[:, :448], "rope": data[:, 448:].contiguous().view(torch.int16),
                "e": gather(fmt, cache, locs, 1).to(torch.int64)}
    if fmt.name == "v4_bf16":
        return {"bf16": gather(fmt, cache, locs, 0).view(torch.int16)}
    if fmt.name == "indexer_fp8":
        return {"codes": gather(fmt, cache, locs, 0), "scale": gather(fmt, cache, locs, 1).view(torch.float32)[:, 0]}
    packed = gather(fmt, cache, locs, 0).to(torch.int64)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(len(locs), 128)   # even dim: low nibble
    return {"codes": nibbles, "e": gather(fmt, cache, locs, 1).to(torch.int64)}


def e4m3_order(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as signed integers monotone in the value (±0 -> 0): one code step = difference 1."""
    c = codes.to(torch.int64)
    return torch.where((c & 0x80) != 0, -(c & 0x7F), c & 0x7F)


def bf16_order(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int16) as signed integers monotone in the value: one ulp = difference 1."""
    b = bits.to(torch.int64) & 0xFFFF
    return torch.where((b & 0x8000) != 0, -(b & 0x7FFF), b & 0x7FFF)


def fp4_order(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int64)
    return torch.where((c & 0x8) != 0, -(c & 0x7), c & 0x7)


def allowed(n: int, fraction: float) -> int:
    return max(1, int(fraction * n))


# --------------------------------------------------------------------------- comparisons

def assert_near_exact(what: str, dev_order: torch.Tensor, ref_order: torch.Tensor, fraction: float,
                      mask: torch.Tensor | None = None) -> None:
    """Equal except on <= ``fraction`` of the (masked) elements, each off by one step."""
    if mask is None:
        mask = torch.ones_like(dev_order, dtype=torch.bool)
    differ = (dev_order != ref_order) & mask
    total = int(mask.sum())
    count = int(differ.sum())
    assert count <= allowed(total, fraction), f"{what}: {count} of {total} differ from the reference"
    if count:
        worst = int((dev_order - ref_order).abs()[differ].max())
        first = differ.nonzero()[0].tolist()
        assert worst <= 1, (f"{what}: differs from the reference by {worst} steps (first at {first}: "
                            f"{int(dev_order[tuple(first)])} vs {int(ref_order[tuple(first)])})")


def assert_scales(what: str, e_dev: torch.Tensor, e_ref: torch.Tensor, amax64: torch.Tensor, qmax: float,
                  rel: float) -> torch.Tensor:
    """UE8M0 bytes equal on >= 99.9 % of tiles; a differing tile must straddle a power of two."""
    differ = e_dev != e_ref
    count = int(differ.sum())
    assert count <= allowed(differ.numel(), SCALE_FLIP_FRACTION), f"{what}: {count} of {differ.numel()} scales differ"
    for idx in differ.nonzero().tolist():
        a, b = int(e_dev[tuple(idx)]), int(e_ref[tuple(idx)])
        assert abs(a - b) == 1, f"{what} at {idx}: exponent {a} vs reference {b}"
        boundary = qmax * 2.0 ** (min(a, b) - 127)
        amax = max(float(amax64[tuple(idx)]), 1e-4)
        assert abs(amax - boundary) <= rel * boundary, (
            f"{what} at {idx}: exponents {a} vs {b}, but amax {amax} is not at the boundary {boundary}")
    return differ


def compare_v4_fp8(dev: dict, ref: dict, y: torch.Tensor) -> None:
    n = y.shape[0]
    amax = y[:, :448].reshape(n, 7, 64).abs().amax(-1)
    # rounding to bf16 first moves amax by <= 2^-9 relative, the fp32 pipeline by far less
    flipped = assert_scales("V4 UE8M0 scale", dev["e"], ref["e"], amax, 448.0, 2.0 ** -7)
    same_scale = (~flipped).repeat_interleave(64, dim=1)
    assert_near_exact("V4 e4m3 code", e4m3_order(dev["codes"]), e4m3_order(ref["codes"]), CODE_FLIP_FRACTION,
                      same_scale)
    assert_near_exact("V4 bf16 rope value", bf16_order(dev["rope"]), bf16_order(ref["rope"]), CODE_FLIP_FRACTION)


def compare_v4_bf16(dev: dict, ref: dict, y: torch.Tensor) -> None:
    assert_near_exact("bf16_store value", bf16_order(dev["bf16"]), bf16_order(ref["bf16"]), CODE_FLIP_FRACTION)


def compare_indexer_fp8(dev: dict, ref: dict, y: torch.Tensor) -> None:
    s_dev, s_ref = dev["scale"].to(torch.float64), ref["scale"].to(torch.float64)
    assert bool((s_ref > 0).all()) and bool(torch.isfinite(s_dev).all())
    rel = ((s_dev - s_ref).abs() / s_ref).max().item()
    assert rel <= INDEXER_FP8_SCALE_RTOL, f"indexer fp8 scale: relative difference {rel} from the reference"
    assert_near_exact("indexer e4m3 code", e4m3_order(dev["codes"]), e4m3_order(ref["codes"]), CODE_FLIP_FRACTION)


def compare_indexer_fp4(dev: dict, ref: dict, y: torch.Tensor) -> None:
    n = y.shape[0]
    amax = y.reshape(n, 4, 32).abs().amax(-1)
    flipped = assert_scales("fp4 UE8M0 scale", dev["e"], ref["e"], amax, 6.0, 2.0 ** -18)
    same_scale = (~flipped).repeat_interleave(32, dim=1)
    assert_near_exact("fp4 code", fp4_order(dev["codes"]), fp4_order(ref["codes"]), FP4_FLIP_FRACTION, same_scale)


COMPARE = {"v4_fp8": compare_v4_fp8, "v4_bf16": compare_v4_bf16, "indexer_fp8": compare_indexer_fp8,
           "indexer_fp4": compare_indexer_fp4}


# ----------------------------------------------------------------- against the fp64 oracle

def assert_within(what: str, got: torch.Tensor, expect: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.to(torch.float64) - expect).abs()
    ok = err <= bound                     # NaN fails
    if not bool(ok.all()):
        i = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~ok).sum())} values beyond the bound; first at {i}: "
                             f"got {float(got[tuple(i)])}, fp64 {float(expect[tuple(i)])}, bound {float(bound[tuple(i)])}")


def oracle_v4_fp8(deq: torch.Tensor, fields: dict, y: torch.Tensor) -> None:
    n = y.shape[0]
    scale = torch.pow(2.0, (fields["e"] - 127).to(torch.float64))                  # [n, 7]
    nope = y[:, :448].reshape(n, 7, 64)
    # the scale is the power of two at or above amax/448 (no saturation), the floored tile uses 1e-4
    amax = nope.abs().amax(-1).clamp_min(1e-4)
    assert bool((amax <= 448 * scale * (1 + 2.0 ** -7)).all()) and bool((amax > 224 * scale * (1 - 2.0 ** -7)).all())
    assert fields["e"][:, 1].tolist() == [127 - 22] * n, "tile 1 (weights ~1e-7) must use the 1e-4 amax floor"
    # e4m3: half a step is <= 2^-4 |x|, plus the bf16 rounding before it; subnormal step 2^-9 · scale
    bound = (2.0 ** -4 + 2.0 ** -7) * nope.abs() + 2.0 ** -9 * scale[..., None]
    assert_within("V4 nope (dequantized) vs fp64", deq[:, :448].reshape(n, 7, 64), nope, bound)
    rope = y[:, 448:]
    slack = 2.0 ** -20 * rope.abs().amax(-1, keepdim=True)       # fp32 rotation: cancellation
    assert_within("V4 rope (bf16) vs fp64", deq[:, 448:], rope, 2.0 ** -8 * rope.abs() + slack)


def oracle_v4_bf16(deq: torch.Tensor, fields: dict, y: torch.Tensor) -> None:
    slack = 2.0 ** -20 * y.abs().amax(-1, keepdim=True)
    assert_within("bf16_store vs fp64", deq, y, 2.0 ** -8 * y.abs() + slack)


def oracle_indexer_fp8(deq: torch.Tensor, fields: dict, y: torch.Tensor) -> None:
    s = fields["scale"].to(torch.float64)[:, None]
    amax = y.abs().amax(-1, keepdim=True)
    expect_s = amax.clamp_min(1e-4) / 448                       # a plain fp32 scale, not a power of two
    assert_within("indexer fp8 scale vs fp64", s, expect_s, 2.0 ** -18 * expect_s)
    bound = (2.0 ** -4 + 2.0 ** -7) * y.abs() + 2.0 ** -9 * s + 2.0 ** -20 * amax
    assert_within("indexer fp8 (dequantized) vs fp64", deq, y, bound)


def oracle_indexer_fp4(deq: torch.Tensor, fields: dict, y: torch.Tensor) -> None:
    n = y.shape[0]
    groups = y.reshape(n, 4, 32)
    s = torch.pow(2.0, (fields["e"] - 127).to(torch.float64))[..., None]           # [n, 4, 1]
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    assert bool((amax <= 6 * s * (1 + 2.0 ** -18)).all()) and bool((amax > 3 * s * (1 - 2.0 ** -18)).all())
    u = groups.abs() / s
    half_step = torch.where(u <= 2, 0.25, torch.where(u <= 4, 0.5, 1.0))          # grid 0 .5 1 1.5 2 3 4 6
    bound = half_step * s + 2.0 ** -20 * amax
    assert_within("indexer fp4 (dequantized) vs fp64", deq.reshape(n, 4, 32), groups, bound)


ORACLE = {"v4_fp8": oracle_v4_fp8, "v4_bf16": oracle_v4_bf16, "indexer_fp8": oracle_indexer_fp8,
          "indexer_fp4": oracle_indexer_fp4}


def check_store(case: Case, got: torch.Tensor, expect: torch.Tensor | None) -> None:
    """All checks of one run: poison outside the owned spans, near-exactness to the reference's cache
    ``expect`` (unless None), the fp64 oracle."""
    fmt = case.fmt
    assert got.dtype == torch.uint8 and (expect is None or got.shape == expect.shape)
    owned = owned_mask(fmt, case.locs, got.shape)
    for name, cache in (("device", got), ("reference", expect)):
        changed = 0 if cache is None else int((cache[~owned] != POISON).sum())
        assert changed == 0, f"{name} cache: {changed} bytes outside the stored tokens' spans were written"
    dev = parse(fmt, got, case.locs)
    y = oracle(case)
    if expect is not None:
        COMPARE[fmt.name](dev, parse(fmt, expect, case.locs), y)
    deq = ref_store.read_cache(fmt.name, got, torch.tensor(case.locs, dtype=torch.int64), fmt.page_size)
    ORACLE[fmt.name](deq, dev, y)


# ------------------------------------------------------------------------------ main matrix

def _matrix():
    params = []
    for fi, fmt in enumerate(FORMATS):
        for di, kv_dtype in enumerate((torch.float32, torch.bfloat16)):
            for decode in (False, True):
                loc_dtype = torch.int32 if (di + decode) % 2 == 0 else torch.int64   # alternates per format
                ident = (f"{fmt.id}-{'fp32' if di == 0 else 'bf16'}-{'decode' if decode else 'prefill'}-"
                         f"{'i32' if loc_dtype == torch.int32 else 'i64'}")
                params.append(pytest.param(fmt, kv_dtype, decode, loc_dtype, 1000 + 10 * fi + 4 * di + decode,
                                           id=ident))
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,kv_dtype,decode,loc_dtype,seed", _matrix())
def test_store_matches_fp64_oracle_and_reference(fmt, kv_dtype, decode, loc_dtype, seed, device):
    """Against the fp64 oracle everywhere, and on "cuda" against the reference's bytes too."""
    case = make_case(fmt, kv_dtype, decode, loc_dtype, seed)
    check_store(case, run_public(case, device), reference_for(case, device))


IDX_FP8_MANY = Fmt("indexer_fp8", 128, 4, 64, 40)  # room for a batch above the 8-lane threshold
IDX_FP4_MANY = Fmt("indexer_fp4", 128, 4, 64, 40, use_fp4=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("fmt,rows", [(f, n) for f in (IDX_FP8, IDX_FP4) for n in (5, 7, 37)]
                         + [(IDX_FP8_MANY, 2053), (IDX_FP4_MANY, 2053)],
                         ids=lambda v: v.id if isinstance(v, Fmt) else str(v))
def test_indexer_row_counts_that_leave_a_warp_part_empty(fmt, decode, rows, device):
    """Indexer rows take 16 lanes (above 2048 rows 8 for fp8 and 4 for fp4, whose codes then come from
    a table and whose lanes trade their code words before the stores), several to a warp: counts that
    leave a warp or a block part empty, on both sides of that threshold."""
    case = make_case(fmt, torch.float32, decode, torch.int32, seed=7000 + rows + 100 * decode, rows=rows)
    check_store(case, run_public(case, device), reference_for(case, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("fmt,rows", [(Fmt("indexer_fp8", 128, 4, 16, 12), ROWS),
                                      (Fmt("indexer_fp4", 128, 4, 1, 192, use_fp4=True), ROWS),
                                      (Fmt("indexer_fp8", 128, 4, 1, 2560), 2053),
                                      (Fmt("indexer_fp4", 128, 4, 1, 2560, use_fp4=True), 2053),
                                      (Fmt("indexer_fp4", 128, 4, 2, 1280, use_fp4=True), 2053),
                                      (Fmt("indexer_fp4", 128, 4, 16, 160, use_fp4=True), 2053)],
                         ids=lambda v: v.id if isinstance(v, Fmt) else str(v))
def test_indexer_pages_of_other_sizes(fmt, decode, rows, device):
    """Indexer pages are unpadded, so the kernels place a token's data and scale rows from its
    location alone (the page's first location times the token bytes): page sizes 1, 2 and 16, on 16
    lanes per row and above 2048 rows on 8 (fp8, and fp4 in pages of one token, whose rows are not
    8-byte aligned) or 4 (fp4 in pages of 2 and 16, which store 8-byte words)."""
    case = make_case(fmt, torch.float32, decode, torch.int64, seed=7500 + rows + 10 * fmt.page_size + decode,
                     rows=rows)
    check_store(case, run_public(case, device), reference_for(case, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("fmt", [V4_C4, V4_C128, IDX_FP4], ids=lambda f: f.id)
def test_store_with_planner_plans(fmt, decode, device):
    """Plans from the real planner (prefill: cuda-graph padded, so trailing rows are invalid) and
    out_loc built as the serving metadata does: raw_out_loc // R for event tokens, else 0 (contract §6.1)."""
    dev = torch.device(device)
    R = fmt.ratio
    assert fmt.page_size == SWA_PAGE // R
    g = gen(2000 + R + decode)
    num_reqs, max_ctx, batch = 6, 1024, 5
    r2t, f2s = random_pool(num_reqs, max_ctx, g)
    rpi = torch.randperm(num_reqs, generator=g)[:batch].to(torch.int64)
    ring = 8 if R == 4 else 128
    events = set()                                       # (loc, rope position) the step must store
    if decode:
        seq = torch.randint(1, max_ctx + 1, (batch,), generator=g)
        seq[0::2] = R * torch.randint(1, max_ctx // R + 1, (len(seq[0::2]),), generator=g)
        plan = CompressorDecodePlan.generate(R, rpi.to(dev), r2t.to(dev), f2s.to(dev), seq.to(dev), SWA_PAGE, ring)
        out_loc = torch.zeros(batch, dtype=torch.int64)
        for b in range(batch):
            if int(seq[b]) % R == 0:
                out_loc[b] = int(r2t[rpi[b], int(seq[b]) - 1]) // R
                events.add((int(out_loc[b]), int(seq[b]) - R))
    else:
        seq, ext = random_batch(batch, g, max_extend=300, max_prefix=600)
        num_q = int(ext.sum())
        plan = CompressorPrefillPlan.generate(R, rpi.to(dev), seq.to(dev), ext.to(dev), r2t.to(dev), f2s.to(dev),
                                              SWA_PAGE, ring, num_q, use_cuda_graph=True)
        assert plan.num_q_tokens == num_q and plan[1].shape[0] == num_q
        out_loc = torch.zeros(num_q, dtype=torch.int64)
        t = 0
        for b in range(batch):
            for pos in range(int(seq[b] - ext[b]), int(seq[b])):
                if (pos + 1) % R == 0:
                    out_loc[t] = int(r2t[rpi[b], pos]) // R
                    events.add((int(out_loc[t]), pos + 1 - R))
                t += 1
    assert events, "the batch must close at least one window"
    n = plan[1].shape[0]
    kv = random_rows(n, fmt.head_dim, g)
    case = Case(fmt, kv, random_weight(fmt.head_dim, g), random_freq_cis(max_ctx, g), plan, out_loc)
    keep, positions, locs = ref_store.select_rows(plan[1].cpu(), out_loc, is_decode=decode, compress_ratio=R)
    case.rows, case.positions, case.locs = keep.tolist(), positions.tolist(), locs.tolist()
    assert set(zip(case.locs, case.positions)) == events
    num_pages = int(r2t.max()) // SWA_PAGE + 1
    expect = poisoned(fmt, num_pages)
    ref_store.compress_norm_rope_store(kv, plan[1].cpu(), is_decode=decode, compress_ratio=R, norm_weight=case.weight,
                                       norm_eps=EPS, freq_cis=case.freq_cis, out_loc=out_loc, kvcache=expect,
                                       page_size=fmt.page_size, **fmt.flags)
    cache = poisoned(fmt, num_pages).to(dev)
    compress_norm_rope_store(kv.to(dev), plan, **op_kwargs(case, dev, cache))
    check_store(case, cache.cpu(), expect)


# ------------------------------------------------------------------------------- empty plans

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["prefill-0-rows", "decode-0-rows", "prefill-all-invalid", "decode-no-boundary"])
def test_nothing_to_store_is_a_noop(kind, device):
    dev = torch.device(device)
    fmt = V4_C4 if kind.startswith("prefill") else IDX_FP8
    R, hd = fmt.ratio, fmt.head_dim
    g = gen(3000)
    if kind == "prefill-0-rows":
        plan = CompressorPrefillPlan(R, torch.zeros(0, 16, dtype=torch.uint8), torch.zeros(0, 8, dtype=torch.uint8),
                                     None, 0)
        out_loc = torch.zeros(0, dtype=torch.int64)
    elif kind == "decode-0-rows":
        plan = CompressorDecodePlan(R, torch.zeros(0, 16, dtype=torch.uint8))
        out_loc = torch.zeros(0, dtype=torch.int32)
    elif kind == "prefill-all-invalid":
        plan = CompressorPrefillPlan(R, invalid_compress_rows(6), encode_write_plan(torch.arange(9), torch.arange(9)),
                                     None, 9)
        out_loc = torch.randperm(fmt.num_pages * fmt.page_size, generator=g)[:9]
    else:
        seq = R * torch.randint(1, 50, (6,), generator=g) - torch.randint(1, R, (6,), generator=g)
        plan = CompressorDecodePlan(R, encode_decode_plan(seq, torch.arange(6), torch.arange(6), torch.arange(6)))
        out_loc = torch.randperm(fmt.num_pages * fmt.page_size, generator=g)[:6]
    case = Case(fmt, random_rows(plan[1].shape[0], hd, g), random_weight(hd, g), random_freq_cis(256, g), plan, out_loc)
    got = run_public(case, dev)
    assert bool((got == POISON).all())


# ------------------------------------------------------------------------- argument checks

def call(case: Case, device, **overrides) -> None:
    dev = torch.device(device)
    kwargs = op_kwargs(case, dev, poisoned(case.fmt).to(dev))
    kv = overrides.pop("kv", case.kv.to(dev))
    plan = overrides.pop("plan", plan_to(case.plan, dev))
    kwargs.update(overrides)
    try:
        compress_norm_rope_store(kv, plan, **kwargs)
    except Exception:
        cache = kwargs["kvcache"]
        if cache.dtype == torch.uint8 and cache.numel():
            assert bool((cache.cpu() == POISON).all()), "a rejected call wrote to the cache"
        raise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("delta", [1, -1])
def test_decode_out_loc_needs_one_entry_per_row(delta, device):
    case = make_case(V4_C128, torch.float32, True, torch.int64, seed=4000)
    out_loc = case.out_loc
    out_loc = torch.cat([out_loc, out_loc[:1]]) if delta > 0 else out_loc[:-1]
    with pytest.raises(ValueError, match="out_loc"):
        call(case, device, out_loc=out_loc.to(device))


def _prefill_case(num_q_tokens, ragged, seed=4100) -> Case:
    """A prefill plan on V4 c4 whose rows use the given ragged ids; out_loc has num_q_tokens entries."""
    g = gen(seed)
    n = len(ragged)
    seq = 4 * torch.randint(1, 20, (n,), generator=g)
    plan_c = encode_compress_plan(seq, torch.tensor(ragged), torch.zeros(n, dtype=torch.int64),
                                  torch.full((n,), -1), torch.full((n,), -1))
    q = num_q_tokens if num_q_tokens is not None else max(ragged) + 1
    plan = CompressorPrefillPlan(4, plan_c, encode_write_plan(torch.arange(q), torch.arange(q)), None, num_q_tokens)
    out_loc = torch.randperm(V4_C4.num_pages * V4_C4.page_size, generator=g)[:q]
    case = Case(V4_C4, random_rows(n, 512, g), random_weight(512, g), random_freq_cis(80, g), plan, out_loc)
    case.rows = list(range(n))
    case.locs = [int(out_loc[r]) for r in ragged]
    case.positions = (seq - 4).tolist()
    return case


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_out_loc_must_cover_num_q_tokens(device):
    """out_loc is indexed by ragged id and must have >= num_q_tokens entries when the plan records
    num_q_tokens (contract §9.2, contract §6.1), even if every ragged id of this plan would fit."""
    case = _prefill_case(16, [3, 9, 0, 7])
    with pytest.raises(ValueError, match="out_loc"):
        call(case, device, out_loc=case.out_loc[:12].to(device))          # all ragged ids < 12
    with pytest.raises(ValueError, match="out_loc"):
        call(case, device, out_loc=case.out_loc[:8].to(device))           # ragged id 9 beyond out_loc
    # exactly num_q_tokens entries (or more) is fine
    longer = _prefill_case(16, [3, 9, 0, 7])
    longer.out_loc = torch.cat([longer.out_loc, torch.zeros(5, dtype=torch.int64)])
    check_store(longer, run_public(longer, device), reference_for(longer, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [3, 48, 0])
def test_page_size_must_be_a_power_of_two(page_size, device):
    case = make_case(V4_C4, torch.float32, False, torch.int64, seed=4200)
    with pytest.raises(ValueError, match="page_size"):
        call(case, device, page_size=page_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.id)
def test_kvcache_rows_must_be_page_bytes(fmt, device):
    case = make_case(fmt, torch.float32, True, torch.int64, seed=4300)
    wrong = [fmt.page_bytes + 16, fmt.page_bytes - 16]
    if fmt.name == "v4_fp8":
        wrong.append(584 * fmt.page_size)            # the unpadded size: V4 pages are padded to 576 B
    for row_bytes in wrong:
        cache = torch.full((fmt.num_pages, row_bytes), POISON, dtype=torch.uint8, device=device)
        with pytest.raises(ValueError, match="kvcache"):
            call(case, device, kvcache=cache)


@pytest.mark.parametrize("device", DEVICES)
def test_format_flags_need_their_head_dim(device):
    indexer = make_case(IDX_FP8, torch.float32, True, torch.int64, seed=4400)
    with pytest.raises(ValueError, match="bf16_store"):
        call(indexer, device, bf16_store=True)
    latent = make_case(V4_C4, torch.float32, True, torch.int64, seed=4401)
    with pytest.raises(ValueError, match="use_fp4"):
        call(latent, device, use_fp4=True)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("arg", ["kv", "plan", "norm_weight", "freq_cis", "out_loc", "kvcache"])
def test_cpu_tensor_among_cuda_tensors_is_a_type_error(arg, device):
    case = make_case(V4_C4, torch.float32, False, torch.int64, seed=4500)
    cpu = {"kv": case.kv, "plan": plan_to(case.plan, "cpu"), "norm_weight": case.weight,
           "freq_cis": case.freq_cis, "out_loc": case.out_loc, "kvcache": poisoned(V4_C4)}[arg]
    with pytest.raises(TypeError):
        call(case, device, **{arg: cpu})


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_fp16_rows_on_the_gpu_are_a_type_error_naming_kv(device):
    """contract §8.4: the kernels take kv in fp32 or bf16; fp16 rows are a bad dtype, a TypeError naming
    `kv` (call() also checks that the rejected call left the cache untouched)."""
    case = make_case(V4_C4, torch.float32, False, torch.int64, seed=4550)
    with pytest.raises(TypeError, match=r"'kv'.*float16"):
        call(case, device, kv=case.kv.to(device, torch.float16))


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_row_stride_must_equal_page_bytes(device):
    """contract §8.4: a [pages, page_bytes] view of a wider buffer (row stride != page_bytes). The kernel
    path must refuse it (ValueError naming kvcache); the CPU reference may instead store through the
    view correctly. Either way nothing outside the view's own bytes changes."""
    dev = torch.device(device)
    case = make_case(V4_C4, torch.float32, False, torch.int64, seed=4600)
    wide = torch.full((V4_C4.num_pages, V4_C4.page_bytes + 64), POISON, dtype=torch.uint8, device=dev)
    view = wide[:, :V4_C4.page_bytes]
    try:
        compress_norm_rope_store(case.kv.to(dev), plan_to(case.plan, dev), **op_kwargs(case, dev, view))
    except ValueError as err:
        assert "kvcache" in str(err)
        assert bool((wide.cpu() == POISON).all())
        return
    assert dev.type == "cpu", "the kernel accepted a kvcache whose row stride is not page_bytes"
    assert bool((wide[:, V4_C4.page_bytes:] == POISON).all())
    check_store(case, view.contiguous(), run_reference(case))


# ---------------------------------------------------- out-of-range data: checked / default mode

GUARD_PAGES = 2


def guarded_cache(fmt: Fmt, device):
    """(buffer, view): the cache is the middle of a larger poisoned buffer with guard pages around it."""
    buf = torch.full((fmt.num_pages + 2 * GUARD_PAGES, fmt.page_bytes), POISON, dtype=torch.uint8,
                     device=torch.device(device))
    return buf, buf[GUARD_PAGES:GUARD_PAGES + fmt.num_pages]


BAD_DATA = ["loc-past-end", "loc-far", "loc-negative", "ragged-beyond-out_loc", "position-beyond-freq",
            "decode-loc-past-end"]


def bad_case(kind: str, fmt: Fmt) -> tuple[Case, Case, str]:
    """(case with one bad stored row, the same case with that row skipped, what checked mode names).
    Indexer rows share a warp (8 lanes each): the bad row's neighbours must still be stored."""
    decode = kind.startswith("decode")
    case = make_case(fmt, torch.float32, decode, torch.int64, seed=5000 + BAD_DATA.index(kind))
    row = case.rows[2]
    num_locs = fmt.num_pages * fmt.page_size
    out_loc = case.out_loc.clone()
    if decode:
        out_loc[row] = num_locs
        skipped_plan = case.plan.plan_d.clone()
        skipped_plan[row] = encode_decode_plan(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    else:
        ragged = int(decode_compress_plan(case.plan.plan_c).ragged_id[row])
        skipped_plan = case.plan.plan_c.clone()
        skipped_plan[row] = invalid_compress_rows(1)
        if kind == "loc-past-end":
            out_loc[ragged] = num_locs
        elif kind == "loc-far":
            out_loc[ragged] = num_locs + 12345 * fmt.page_size
        elif kind == "loc-negative":
            out_loc[ragged] = -1
    bad = Case(fmt, case.kv, case.weight, case.freq_cis, case.plan, out_loc)
    what = "out_loc"
    if kind == "ragged-beyond-out_loc":
        # the plan records no num_q_tokens, so only the kernel can see the ragged id beyond out_loc
        plan_c = case.plan.plan_c.clone()
        plan_c[row, 4:6] = torch.tensor([len(out_loc)], dtype=torch.int16).view(torch.uint8)
        bad.plan = CompressorPrefillPlan(fmt.ratio, plan_c, case.plan.plan_w, None, None)
    elif kind == "position-beyond-freq":
        plan_c = case.plan.plan_c.clone()
        seq_len = len(case.freq_cis) + fmt.ratio                 # position == max_pos
        plan_c[row, 0:4] = torch.tensor([seq_len], dtype=torch.int32).view(torch.uint8)
        bad.plan = CompressorPrefillPlan(fmt.ratio, plan_c, case.plan.plan_w, None, case.plan.num_q_tokens)
        what = "freq_cis"
    good = Case(fmt, case.kv, case.weight, case.freq_cis, case.plan, case.out_loc,
                [r for r in case.rows if r != row],
                [l for r, l in zip(case.rows, case.locs) if r != row],
                [p for r, p in zip(case.rows, case.positions) if r != row])
    good.plan = (CompressorDecodePlan(fmt.ratio, skipped_plan) if decode
                 else CompressorPrefillPlan(fmt.ratio, skipped_plan, case.plan.plan_w, None, case.plan.num_q_tokens))
    return bad, good, what


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("fmt", [V4_C4, IDX_FP8], ids=lambda f: f.id)
@pytest.mark.parametrize("kind", BAD_DATA)
def test_checked_mode_reports_out_of_range_data(kind, fmt, device):
    bad, _, what = bad_case(kind, fmt)
    buf, view = guarded_cache(bad.fmt, device)
    dsv4jit.set_checks(True)
    try:
        with pytest.raises(ValueError, match=what):
            compress_norm_rope_store(bad.kv.to(device), plan_to(bad.plan, device), **op_kwargs(bad, device, view))
    finally:
        dsv4jit.set_checks(None)
    torch.cuda.synchronize()
    buf = buf.cpu()
    assert bool((buf[:GUARD_PAGES] == POISON).all()) and bool((buf[-GUARD_PAGES:] == POISON).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [V4_C4, IDX_FP8], ids=lambda f: f.id)
@pytest.mark.parametrize("kind", BAD_DATA)
def test_default_mode_never_writes_out_of_bounds(kind, fmt, device):
    """Default mode does not sync, so the kernel skips the bad row and stores the others; the CPU
    backend may refuse the call up front (ValueError, nothing written). The guard pages around the
    cache view keep their poison either way."""
    dev = torch.device(device)
    bad, good, _ = bad_case(kind, fmt)
    buf, view = guarded_cache(bad.fmt, dev)
    dsv4jit.set_checks(False)
    try:
        compress_norm_rope_store(bad.kv.to(dev), plan_to(bad.plan, dev), **op_kwargs(bad, dev, view))
        raised = False
    except ValueError:
        raised = True
    finally:
        dsv4jit.set_checks(None)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    buf = buf.cpu()
    assert bool((buf[:GUARD_PAGES] == POISON).all()), "wrote before the cache"
    assert bool((buf[-GUARD_PAGES:] == POISON).all()), "wrote past the cache"
    inner = buf[GUARD_PAGES:-GUARD_PAGES]
    if raised:
        assert dev.type == "cpu", "default mode must not raise for data-dependent errors (no sync)"
        assert bool((inner == POISON).all()), "a refused call wrote to the cache"
    else:
        check_store(good, inner, run_reference(good))


# ----------------------------------------------------------- the checks themselves are not vacuous

CORRUPTIONS = ["code-two-steps", "many-codes-one-step", "scale-off-boundary", "scale-byte-7", "unstored-slot",
               "rope-swapped", "fp4-many-codes", "fp8-scale"]


def _step_e4m3(code: int, steps: int) -> int:
    mag = code & 0x7F
    mag = mag - steps if mag >= steps else mag + steps       # stays below 0x7F (NaN)
    return (code & 0x80) | mag


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_checks_reject_wrong_stores(corruption, device):
    """The op's real result passes check_store; each corrupted copy of it must fail."""
    fmt = IDX_FP4 if corruption.startswith("fp4") else IDX_FP8 if corruption == "fp8-scale" else V4_C4
    case = make_case(fmt, torch.float32, False, torch.int64, seed=6000)
    expect = run_reference(case)
    got = run_public(case, device)
    check_store(case, got, expect)
    bad = got.clone()
    ps = fmt.page_size
    page, slot = divmod(case.locs[0], ps)
    g = gen(6001)
    if corruption == "code-two-steps":
        bad[page, slot * 576 + 3] = _step_e4m3(int(bad[page, slot * 576 + 3]), 2)
    elif corruption == "many-codes-one-step":
        for loc in case.locs:
            p, s = divmod(loc, ps)
            for d in torch.randperm(448, generator=g)[:10].tolist():     # ~2 % of the codes
                bad[p, s * 576 + d] = _step_e4m3(int(bad[p, s * 576 + d]), 1)
    elif corruption == "scale-off-boundary":
        bad[page, ps * 576 + slot * 8] += 1
    elif corruption == "scale-byte-7":
        bad[page, ps * 576 + slot * 8 + 7] = 0
    elif corruption == "unstored-slot":
        free = next(loc for loc in range(fmt.num_pages * ps) if loc not in case.locs)
        p, s = divmod(free, ps)
        bad[p, s * 576 + 100] = 0
    elif corruption == "rope-swapped":
        p1, s1 = divmod(case.locs[1], ps)
        a, b = bad[page, slot * 576 + 448:slot * 576 + 576].clone(), bad[p1, s1 * 576 + 448:s1 * 576 + 576].clone()
        bad[page, slot * 576 + 448:slot * 576 + 576], bad[p1, s1 * 576 + 448:s1 * 576 + 576] = b, a
    elif corruption == "fp4-many-codes":
        for loc in case.locs:
            p, s = divmod(loc, ps)
            for i in torch.randperm(64, generator=g)[:2].tolist():         # ~1.6 % of the nibbles
                byte = int(bad[p, s * 64 + i])
                lo = byte & 0xF
                lo = (lo & 0x8) | ((lo & 0x7) - 1 if lo & 0x7 else 1)
                bad[p, s * 64 + i] = (byte & 0xF0) | lo
    elif corruption == "fp8-scale":
        off = ps * 128 + slot * 4
        scale = bad[page, off:off + 4].clone().view(torch.float32) * (1 + 2.0 ** -17)
        bad[page, off:off + 4] = scale.view(torch.uint8)
    assert not torch.equal(bad, got)
    with pytest.raises(AssertionError):
        check_store(case, bad, expect)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_fp4_codec_equals_the_threshold_rule_on_every_fp32(device):
    """The kernels' e2m1 codecs (fp4_code: from 1 up it rounds the fp32 mantissa bits; its table, by
    the fp32 bits' exponent and two leading mantissa bits) against reference.quant.fp4_encode (the
    threshold rule of contract §6.6) on all 2^32 fp32 bit patterns: ties, subnormals, ±0, infinities and NaNs
    included. Each codec codes the pair (x, x) into one byte, so both nibble positions are checked."""
    dev = torch.device(device, torch.cuda.current_device())
    codes = runtime.function("store_probes", "fp4_codes", dev)
    chunk = 1 << 28
    out = torch.full((chunk, 2), 0xFF, dtype=torch.uint8, device=dev)
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=dev)
        x = (bits - (1 << 32) * (bits >= 1 << 31)).to(torch.int32).view(torch.float32)
        codes(x, out)
        code = fp4_encode(x)
        expected = code | code << 4
        for col, codec in enumerate(("fp4_code", "table")):
            bad = (out[:, col] != expected).nonzero()
            assert bad.numel() == 0, (f"{codec}: {bad.numel()} codes differ from {start:#010x} on, first at bit "
                                      f"pattern {start + int(bad[0]):#010x}: {int(out[bad[0], col])} != "
                                      f"{int(expected[bad[0]])}")


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_scale_exponents_equal_the_division_rule_on_every_fp32(device):
    """The division-free UE8M0 scale exponent (from amax's bits) against
    reference.quant.ue8m0_exponent(max(amax, 1e-4) / D) on all non-negative fp32 bit patterns (below
    the floor, subnormals, every mantissa, infinity, NaNs): D = 6, the fp4 groups' rule, and D = 448,
    the V4 tiles' rule in the standalone store (the fused kernels divide)."""
    dev = torch.device(device, torch.cuda.current_device())
    exponents = runtime.function("store_probes", "scale_exponents", dev)
    chunk = 1 << 28
    out = torch.full((chunk, 2), -1, dtype=torch.int32, device=dev)
    for start in range(0, 1 << 31, chunk):
        amax = torch.arange(start, start + chunk, dtype=torch.int32, device=dev).view(torch.float32)
        exponents(amax, out)
        floored = torch.where(amax.isnan(), 1e-4, amax).clamp_min(1e-4)
        for col, divisor in enumerate((6.0, 448.0)):
            expected = ue8m0_exponent(floored / divisor).to(torch.int32)
            bad = (out[:, col] != expected).nonzero()
            assert bad.numel() == 0, (f"D={divisor}: {bad.numel()} exponents differ from {start:#010x} on, first at "
                                      f"bit pattern {start + int(bad[0]):#010x}: {int(out[bad[0], col])} != "
                                      f"{int(expected[bad[0]])}")
