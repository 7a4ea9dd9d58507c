"""``dsv4jit.warmup``: build and load, ahead of time, every kernel variant a model configuration reaches.

(The module is not named ``warmup``: a submodule of that name would shadow the function on the package.)

A variant the ops meet for the first time compiles (seconds) and loads; during CUDA-graph capture or
torch.compile tracing, or under a serving start-up timeout, that is too late. Each kernel family
declares, next to the function its calls pick their variant with, a ``Family`` whose reach maps a
configuration to the (kernel, parameters) those calls resolve to (``dsv4jit.family``); `FAMILIES`
lists them by the name ``ops`` takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Optional, Union

import torch

from . import arguments, compat, env, plan, runtime
from .errors import ArgumentError, ArgumentTypeError
from .family import ModelConfig
from .jit import batch, loader
from .jit.registry import Variant, unique
from .jit.toolchain import Arch
from .kv_layout import KVLayout
from .ops import c2_pool, compress, fused, layer, low_ratio, online, online_mtp, store

_OP = "warmup"

#: DeepSeek-V4: c4 layers compress the latent (512) and the indexer keys (128), c128 layers the latent.
MODEL_HEAD_DIMS: Mapping[int, tuple[int, ...]] = {4: (512, 128), 128: (512,)}

#: op family -> what its calls reach: "plan" (CompressorPrefillPlan/CompressorDecodePlan),
#: "compress" (compress_forward), "store" (compress_norm_rope_store), "fused" (compress_and_store),
#: "online" (compress_forward(is_online=True), the c128 layers), "fused_online"
#: (compress_and_store(is_online=True), the c128 latent), "c4_layer" (compress_and_store_c4_layer),
#: "online_mtp" (online c128's speculative-decoding ops), "compat" (dsv4jit.compat, the c4 layers),
#: "low_ratio" (the DeepSeek-V4.1 ratio-1 and ratio-2 compressors), "c2_decode_pool" (ratio-2 decode
#: pooling alone).
FAMILIES = {f.name: f for f in (plan.FAMILY, compress.FAMILY, store.FAMILY, fused.FAMILY, online.FAMILY,
                                fused.ONLINE_FAMILY, layer.FAMILY, online_mtp.FAMILY, compat.FAMILY, low_ratio.FAMILY,
                                c2_pool.FAMILY)}


def _target(device, arch: Optional[str]) -> Arch:
    if arch is not None:
        if not isinstance(arch, str):
            raise ArgumentTypeError(f"dsv4jit.{_OP}: argument 'arch' must be a str such as '9.0a' or 'sm_90a', got "
                                    f"{type(arch).__name__} {arch!r}")
        try:
            return Arch.parse(arch)
        except ValueError as e:
            raise ArgumentError(f"dsv4jit.{_OP}: argument 'arch': {e}") from None
    if device is None:  # DSV4JIT_CUDA_ARCH, else the current device (an error without either)
        return loader.arch_for(None)
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError(f"dsv4jit.{_OP}: argument 'device' must be a torch device, a device string or a CUDA "
                            f"device index, got {device!r}") from None
    return loader.arch_for(device)


def _layouts(layout, head_dims: Mapping[int, tuple[int, ...]]) -> dict[int, str]:
    """ratio -> KVLayout value of its latent cache, from warmup's `layout`: one layout for every ratio,
    or a mapping ratio -> layout (ratios it does not name: v4)."""
    per_ratio = layout if isinstance(layout, Mapping) else dict.fromkeys(head_dims, layout)
    try:
        return {arguments.integer(_OP, "layout", ratio): KVLayout.parse(value).value for ratio, value in per_ratio.items()}
    except ValueError as e:
        raise arguments.reworded(_OP, e, ("layout",)) from None


def variants(arch: Union[Arch, str], *, head_dims: Optional[Mapping[int, Iterable[int]]] = None,
             state_dtype: torch.dtype = torch.float32, input_dtype: torch.dtype = torch.float32,
             output_dtype: Optional[torch.dtype] = None, use_fp4: bool = False, bf16_store: bool = False,
             layout: Union[str, Mapping[int, str]] = "v4", ops: Iterable[str] = ("plan", "compress", "store")
             ) -> list[Variant]:
    """The variants `warmup` builds for `arch` (as warmup's ``arch`` takes it, e.g. ``"9.0a"``, or an
    `Arch`), with warmup's keyword arguments; the host target reaches the CPU planner only."""
    if not isinstance(arch, Arch):
        arch = _target(None, arch)
    unknown = sorted(set(ops) - set(FAMILIES))
    if unknown:
        raise ArgumentError(f"dsv4jit.{_OP}: argument 'ops' has unknown entries {unknown}; known: {sorted(FAMILIES)}")
    if arch.is_host:  # CPU tensors: the compressors run as torch references, no head dim reaches a kernel
        cfg = ModelConfig({}, host=True)
    else:
        dims = {arguments.integer(_OP, "head_dims", r): tuple(arguments.integer(_OP, "head_dims", hd) for hd in hds)
                for r, hds in (head_dims or MODEL_HEAD_DIMS).items()}
        cfg = ModelConfig(dims, arguments.dtype_key(state_dtype, _OP, "state_dtype"),
                          arguments.dtype_key(input_dtype, _OP, "input_dtype"),
                          arguments.dtype_key(output_dtype or input_dtype, _OP, "output_dtype"),
                          arguments.flag(_OP, "use_fp4", use_fp4), arguments.flag(_OP, "bf16_store", bf16_store),
                          layouts=_layouts(layout, dims))
    try:
        return unique(runtime.variant(kernel, **params) for op in ops for kernel, params in FAMILIES[op].reach(cfg))
    except ValueError as e:  # a head_dim no kernel (or no store format) has
        if str(e).startswith("head_dims"):
            raise arguments.reworded(_OP, e, ("head_dims",)) from None
        raise ArgumentError(f"dsv4jit.{_OP}: argument 'head_dims': {e}") from None


def warmup(device: Union[torch.device, str, int, None] = None, *,
           head_dims: Optional[Mapping[int, Iterable[int]]] = None, state_dtype: torch.dtype = torch.float32,
           input_dtype: torch.dtype = torch.float32, output_dtype: Optional[torch.dtype] = None,
           use_fp4: bool = False, bf16_store: bool = False, layout: Union[str, Mapping[int, str]] = "v4",
           ops: Iterable[str] = ("plan", "compress", "store"), arch: Optional[str] = None,
           jobs: Optional[int] = None) -> list[str]:
    """Compile (in parallel) and load every kernel variant a model configuration reaches.

    Call it once per process before CUDA-graph capture and before torch.compile tracing, so that no
    op compiles or loads a module while being captured or traced. Kernel launches are not part of
    it: keep the usual eager warm-up pass before capture. Returns the ids of the variants loaded.

    device: the GPU the ops will run on (default: the current CUDA device); it picks the target
        arch. Loaded modules serve every device of that arch, so one call covers a node of identical
        GPUs; call once per device kind on a mixed node. ``"cpu"`` builds the host planner only
        (on CPU tensors compress and store run the torch references).
    head_dims: compress ratio -> head dims of its compressors; default DeepSeek-V4
        ``{4: (512, 128), 128: (512,)}`` (latent 512 on both, indexer 128 on c4 layers).
    state_dtype, input_dtype, output_dtype: dtypes of kv_score_buffer, kv_score_input and the
        compressed rows (default: the input dtype, as compress_forward allocates them).
    use_fp4, bf16_store: the store formats, as passed to compress_norm_rope_store (use_fp4 for the
        indexer, bf16_store for the latent).
    layout: the KVLayout of the latent caches, as the ops take it: one for every ratio, or a mapping
        ratio -> layout (DeepSeek-V4.1: e.g. ``{4: "v41", 128: "v41"}``; unnamed ratios: v4).
    ops: op families to cover: "plan", "compress", "store", "fused" (compress_and_store), "online"
        (compress_forward(is_online=True) for the c128 head dims), "fused_online"
        (compress_and_store(is_online=True), the c128 latent), "c4_layer"
        (compress_and_store_c4_layer, for c4 layers of head dims 512 and 128), "online_mtp" (online
        c128's speculative-decoding ops), "compat" (dsv4jit.compat, for the c4 head dims).
    arch: build for this target instead (``"9.0a"``, ``"10.0a"`` or ``"12.0a"``; another is a
        ValueError naming these): works on a machine without a GPU when nvcc is installed (the
        modules load there too, they just cannot run).
    jobs: parallel compiles (default: memory-aware, as ``python -m dsv4jit precompile``).

    PDL is on unless ``DSV4JIT_DISABLE_PDL``, as in the ops and ``precompile``. With
    ``DSV4JIT_NO_COMPILE=1`` nothing compiles and a missing variant raises ``DSV4JITCacheMiss``.
    """
    if jobs is not None:
        jobs = arguments.integer(_OP, "jobs", jobs)
    target = _target(device, arch)
    todo = variants(target, head_dims=head_dims, state_dtype=state_dtype, input_dtype=input_dtype,
                    output_dtype=output_dtype, use_fp4=use_fp4, bf16_store=bf16_store, layout=layout, ops=ops)
    _build_missing(todo, target, jobs)
    for v in todo:  # cache hits now: a dlopen each
        loader.load(v, target)
    return [v.id for v in todo]


def _build_missing(todo: list[Variant], arch: Arch, jobs: Optional[int]) -> None:
    """Compile the cache misses in parallel (loader.load compiles one at a time). Misses that cannot
    be built here (no toolchain, DSV4JIT_NO_COMPILE) are left to loader.load, which explains them."""
    if env.no_compile():
        return
    missing = [r for r in (loader.resolve(v, arch) for v in todo) if r.entry is None and r.toolchain_error is None]
    if not missing:
        return
    failures = batch.build_all(missing, "warmup", jobs).failures
    if failures:  # every build has been tried, so the others are cached for the next attempt
        raise failures[0].error
