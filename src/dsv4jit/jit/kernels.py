"""The catalogue: every kernel module dsv4jit can build, with its default serving set."""

from __future__ import annotations

from ..geometry import FORMATS
from .registry import KernelSpec, Param

PDL = Param("pdl", "bool", (False, True))

SELFTEST = KernelSpec(
    name="selftest",
    header="selftest.cuh",
    params=(Param("dtype", "dtype", ("fp32", "bf16")), PDL),
    exports={"affine": "dsv4::SelfTestEntry<{dtype}, {pdl}>::affine"},
    serving=({"dtype": "fp32"},),
    doc="out = x * alpha + beta; toolchain and loader checks",
)

PLAN = KernelSpec(
    name="plan",
    header="planner/plan.cuh",
    params=(PDL,),
    exports={"prefill_device": "dsv4::plan::PlannerEntry<{pdl}>::prefill_device",
             "prefill_host_lengths": "dsv4::plan::PlannerEntry<{pdl}>::prefill_host_lengths",
             "decode": "dsv4::plan::PlannerEntry<{pdl}>::decode",
             "prefill_counts": "dsv4::plan::prefill_counts",
             "describe_status": "dsv4::plan::describe_status",
             "prefill_online_device": "dsv4::plan::PlannerEntry<{pdl}>::prefill_online_device",
             "prefill_online_host_lengths": "dsv4::plan::PlannerEntry<{pdl}>::prefill_online_host_lengths",
             "decode_online": "dsv4::plan::PlannerEntry<{pdl}>::decode_online",
             "prefill_online_counts": "dsv4::plan::prefill_online_counts"},
    serving=({},),
    doc="compress/write/decode plans from device- or host-resident lengths",
)

PLAN_HOST = KernelSpec(
    name="plan_host",
    header="planner/host.h",
    params=(),
    exports={"prefill": "dsv4::plan::HostPlannerEntry::prefill", "decode": "dsv4::plan::HostPlannerEntry::decode",
             "prefill_counts": "dsv4::plan::prefill_counts",
             "prefill_online": "dsv4::plan::HostPlannerEntry::prefill_online",
             "decode_online": "dsv4::plan::HostPlannerEntry::decode_online",
             "prefill_online_counts": "dsv4::plan::prefill_online_counts"},
    serving=({},),
    target="host",
    doc="the planner on the CPU (all inputs and plans on the host)",
)

FLOAT = ("fp32", "bf16", "fp16")


def _compress(ratio: int, head_dims: tuple[int, ...], serving_dims: tuple[int, ...]) -> KernelSpec:
    entry = "dsv4::compress::CompressEntry<%d, {head_dim}, {state}, {input}, {output}, {pdl}>" % ratio
    return KernelSpec(
        name=f"compress_c{ratio}",
        header="compress/ring.cuh",
        params=(Param("head_dim", "int", head_dims), Param("state", "dtype", ("fp32", "bf16")),
                Param("input", "dtype", FLOAT), Param("output", "dtype", FLOAT), PDL),
        exports={"prefill": entry + "::prefill", "decode": entry + "::decode",
                 "describe_status": "dsv4::compress::describe_status"},
        serving=tuple({"head_dim": hd, "state": st, "input": "fp32", "output": "fp32"}
                      for hd in serving_dims for st in ("fp32", "bf16")),
        doc=f"ratio-{ratio} window softmax pooling and state-ring writes (prefill and decode)",
    )


COMPRESS_C4 = _compress(4, (128, 256, 512), (512, 128))
COMPRESS_C128 = _compress(128, (64, 128, 256, 512), (512,))

STORE_FORMATS = FORMATS  # in the order of dsv4::store::Format
_FORMAT_CPP = tuple(f"dsv4::store::Format::k{n}" for n in ("V4Fp8", "V4Bf16", "IndexerFp8", "IndexerFp4", "V41",
                                                            "V41Fp4", "UniformFp8", "V41New", "V41Fp4New", "V4TwoPool"))
STORE_FORMAT = Param("format", "enum", STORE_FORMATS, _FORMAT_CPP)
#: The latent formats (head_dim 512): V4's (fp8, bf16 rows, two pools) and the V4.1 layouts.
_LATENT = tuple(f for f in STORE_FORMATS if not f.startswith("indexer"))
LATENT_FORMAT = Param("format", "enum", _LATENT, tuple(_FORMAT_CPP[STORE_FORMATS.index(f)] for f in _LATENT))
#: What a DeepSeek-V4.1 serving step stores a compressed c4 / c128 row as by default: the fp8 encoding
#: beside a V4.1 main cache, block-split or interleaved (contract §10).
V41_SERVING_FORMATS = ("v41",)
STORE = KernelSpec(
    name="store",
    header="store/store.cuh",
    params=(Param("dtype", "dtype", ("fp32", "bf16")), STORE_FORMAT, PDL),
    exports={"run": "dsv4::store::NormRopeStoreEntry<{dtype}, {format}, {pdl}>::run",
             "describe_status": "dsv4::store::describe_status"},
    serving=tuple({"dtype": "fp32", "format": f} for f in (*STORE_FORMATS[:4], *V41_SERVING_FORMATS)),
    doc="RMSNorm + RoPE (+ Hadamard) + quantize + paged store of compressed rows",
)

# Test-only: no op calls it, so it has no serving set (precompile builds it only when asked for).
STORE_PROBES = KernelSpec(
    name="store_probes",
    header="store/probes.cuh",
    params=(),
    exports={"fp4_codes": "dsv4::store::fp4_codes", "scale_exponents": "dsv4::store::scale_exponents",
             "v41_codes": "dsv4::store::v41_codes", "short_quotients": "dsv4::store::short_quotients",
             "exp_nonpositive": "dsv4::store::exp_nonpositive", "unit_quotients": "dsv4::store::unit_quotients"},
    doc="test-only probes of the store's fp4 codecs, UE8M0 exponents, V4.1 codes and quotients by a tile "
        "scale, and of the pair poolings' exp and quotients, over any fp32 inputs",
)


_FUSED_ENTRY = "dsv4::fused::CompressAndStoreEntry<{ratio}, {state}, {input}, {format}, {pdl}>"
FUSED = KernelSpec(
    name="fused",
    header="fused/fused.cuh",
    params=(Param("ratio", "int", (4, 128)), STORE_FORMAT, Param("state", "dtype", ("fp32", "bf16")),
            Param("input", "dtype", ("fp32", "bf16")), PDL),
    exports={"run": _FUSED_ENTRY + "::run",
             "describe_compress_status": "dsv4::compress::describe_status",
             "describe_store_status": "dsv4::store::describe_status"},
    serving=tuple({"ratio": r, "format": f, "state": "fp32", "input": "fp32"}
                  for r, f in ((4, "v4_fp8"), (4, "indexer_fp4"), (4, "indexer_fp8"), (128, "v4_fp8"),
                               *((r, f) for f in V41_SERVING_FORMATS for r in (4, 128)))),
    doc="compress + RMSNorm + RoPE (+ Hadamard) + quantize + paged store in one kernel (head_dim from the format)",
    reject=lambda v: ("ratio 128 stores V4 rows (head_dim 512) only, not the indexer formats"
                      if v["ratio"] == 128 and v["format"].startswith("indexer") else None),
)

_C4_LAYER_ENTRY = "dsv4::fused::C4LayerEntry<{state}, {input}, {core_format}, {indexer_format}, {pdl}>"
C4_LAYER = KernelSpec(
    name="fused_c4_layer",
    header="fused/layer.cuh",
    params=(Param("core_format", "enum", LATENT_FORMAT.choices, LATENT_FORMAT.cpp_names),
            Param("indexer_format", "enum", STORE_FORMATS[2:4], _FORMAT_CPP[2:4]),
            Param("state", "dtype", ("fp32", "bf16")), Param("input", "dtype", ("fp32", "bf16")), PDL),
    exports={"run": _C4_LAYER_ENTRY + "::run",
             "describe_compress_status": "dsv4::compress::describe_status",
             "describe_store_status": "dsv4::store::describe_status"},
    serving=tuple({"core_format": c, "indexer_format": f, "state": "fp32", "input": "fp32", "pdl": True}
                  for c in ("v4_fp8", *V41_SERVING_FORMATS) for f in ("indexer_fp4", "indexer_fp8")),
    doc="a c4 layer's core and indexer compressor steps (compress_and_store of each) in one launch",
)

_COMPAT_ENTRY = "dsv4::compat::CompatC4Entry<{head_dim}, {state}, {input}, {output}, {pdl}>"
COMPAT_C4 = KernelSpec(
    name="compat_c4",
    header="compat/compat_c4.cuh",
    params=(Param("head_dim", "int", (128, 512)), Param("state", "dtype", ("fp32", "bf16")),
            Param("input", "dtype", FLOAT), Param("output", "dtype", FLOAT), PDL),
    exports={"decode": _COMPAT_ENTRY + "::decode", "prefill": _COMPAT_ENTRY + "::prefill",
             "describe_status": "dsv4::compat::describe_status"},
    serving=tuple({"head_dim": hd, "state": "fp32", "input": "fp32", "output": "fp32"}
                  for hd in (512, 128)),
    doc="the older c4 entry points (indices/seq_lens, ring or 4-aligned pages, ragged-indexed output)",
)

_ONLINE_ENTRY = "dsv4::compress::online::OnlineEntry<{head_dim}, {state}, {pdl}>"
COMPRESS_ONLINE = KernelSpec(
    name="compress_online",
    header="compress/online.cuh",
    params=(Param("head_dim", "int", (128, 256, 512)), Param("state", "dtype", ("fp32", "bf16")), PDL),
    exports={"prefill": _ONLINE_ENTRY + "::prefill", "decode": _ONLINE_ENTRY + "::decode",
             "describe_status": "dsv4::compress::online::describe_status"},
    serving=tuple({"head_dim": 512, "state": st} for st in ("fp32", "bf16")),
    doc="online c128: one running softmax state row per request (prefill segments and decode steps)",
)

_ONLINE_MTP_ENTRY = "dsv4::compress::online_mtp::DraftStatesEntry<{head_dim}, {state}, {pdl}>"
ONLINE_MTP = KernelSpec(
    name="online_mtp",
    header="compress/online_mtp.cuh",
    params=(Param("head_dim", "int", (128, 256, 512)), Param("state", "dtype", ("fp32", "bf16")), PDL),
    exports={"write_prefix_states": _ONLINE_MTP_ENTRY + "::write_prefix_states",
             "mark_pending": _ONLINE_MTP_ENTRY + "::mark_pending",
             "commit_pending": _ONLINE_MTP_ENTRY + "::commit_pending",
             "describe_status": "dsv4::compress::online_mtp::describe_status"},
    serving=tuple({"head_dim": 512, "state": st, "pdl": True} for st in ("fp32", "bf16")),
    doc="online c128 with speculative decoding: draft states of a verify step, pending lengths, commit",
)

_FUSED_ONLINE_ENTRY = "dsv4::fused::OnlineCompressAndStoreEntry<{state}, {format}, {pdl}>"
FUSED_ONLINE = KernelSpec(
    name="fused_online",
    header="fused/fused.cuh",
    params=(LATENT_FORMAT, Param("state", "dtype", ("fp32", "bf16")), PDL),
    exports={"run": _FUSED_ONLINE_ENTRY + "::run",
             "describe_compress_status": "dsv4::compress::online::describe_status",
             "describe_store_status": "dsv4::store::describe_status"},
    serving=tuple({"format": "v4_fp8", "state": st} for st in ("fp32", "bf16")),
    doc="online c128 + RMSNorm + RoPE + quantize + paged store in one kernel (head_dim 512, fp32 rows)",
)

#: The latent caches of the ratio-1 and ratio-2 compressors: v4 (fp8) and the V4.1 layouts.
_LOW_RATIO = tuple(f for f in _LATENT if f not in ("v4_bf16", "v4_fp8_2buff"))
LOW_RATIO_FORMAT = Param("format", "enum", _LOW_RATIO, tuple(_FORMAT_CPP[STORE_FORMATS.index(f)] for f in _LOW_RATIO))
#: What a DeepSeek-V4.1 serving step stores ratio-1 / ratio-2 rows as by default beside a v41 main cache: the
#: fp4 encoding (contract §10.1); v4 beside a V4 main cache.
_LOW_RATIO_SERVING = ("v41_fp4", "v4_fp8")

C1 = KernelSpec(
    name="c1",
    header="lowratio/c1.cuh",
    params=(LOW_RATIO_FORMAT, PDL),
    exports={"run": "dsv4::lowratio::C1Entry<{format}, {pdl}>::run",
             "describe_status": "dsv4::lowratio::describe_status"},
    serving=tuple({"format": f} for f in _LOW_RATIO_SERVING),
    doc="ratio-1 compressor: RMSNorm latent, RoPE, paged store of every row (decode and extend)",
)

C2 = KernelSpec(
    name="c2",
    header="lowratio/c2.cuh",
    params=(LOW_RATIO_FORMAT, PDL),
    exports={"decode": "dsv4::lowratio::C2Entry<{format}, {pdl}>::decode",
             "prefill": "dsv4::lowratio::C2Entry<{format}, {pdl}>::prefill",
             "describe_status": "dsv4::lowratio::describe_status"},
    serving=tuple({"format": f} for f in _LOW_RATIO_SERVING),
    doc="ratio-2 compressor: pair pooling with the pair ring, RMSNorm latent, RoPE, paged store",
)

C2_POOL = KernelSpec(
    name="c2_pool",
    header="lowratio/c2_pool.cuh",
    params=(PDL,),
    exports={"run": "dsv4::lowratio::C2PoolEntry<{pdl}>::run",
             "describe_status": "dsv4::lowratio::describe_pool_status"},
    serving=({},),
    doc="ratio-2 decode pair pooling alone (pooled rows, group positions, slots)",
)

SPECS: dict[str, KernelSpec] = {s.name: s for s in (SELFTEST, PLAN, PLAN_HOST, COMPRESS_C4, COMPRESS_C128, STORE,
                                                    STORE_PROBES, FUSED, C4_LAYER, COMPAT_C4, COMPRESS_ONLINE, ONLINE_MTP,
                                                    FUSED_ONLINE, C1, C2, C2_POOL)}
