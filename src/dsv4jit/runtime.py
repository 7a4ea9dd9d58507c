"""From a torch device to a loaded kernel function: arch, PDL default, memo; and a self check of
that path (``python -m dsv4jit info --check``).

This is the only place the ops layer touches the loader; lookups after the first are one dict hit.
The ops' eager fast paths keep their per-signature decisions in caches made here (`call_cache`),
which a change of checked mode clears.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import env
from .errors import ArgumentError, ArgumentTypeError, DSV4JITError
from .jit import loader
from .jit.kernels import SPECS
from .jit.registry import Variant
from .jit.toolchain import Arch

_FUNCTIONS: dict[tuple, object] = {}
_checks: list[bool] = []  # resolved once: DSV4JIT_CHECK is read at first use, set_checks overrides
_kernel_allocation: list[bool] = []  # resolved once, by kernels_allocate()
_CALL_CACHES: list[dict] = []


def call_cache() -> dict:
    """A dict for an op's eager fast path (signature -> launcher), emptied whenever checked mode
    changes: a launcher is made for unchecked calls only."""
    cache: dict = {}
    _CALL_CACHES.append(cache)
    return cache


def set_checks(enabled: bool | None) -> None:
    """Checked mode (data-dependent validation with a device sync); None re-reads DSV4JIT_CHECK."""
    if enabled is not None and type(enabled) is not bool:
        raise ArgumentTypeError(f"dsv4jit.set_checks: argument 'enabled' must be a bool or None, got "
                                f"{type(enabled).__name__} {enabled!r}")
    _checks[:] = [env.checks() if enabled is None else enabled]
    clear_call_caches()


def clear_call_caches() -> None:
    """Forget every op's per-signature decisions (the next call of each signature takes the full path)."""
    for cache in _CALL_CACHES:
        cache.clear()


def checks_enabled() -> bool:
    if not _checks:
        _checks.append(env.checks())
    return _checks[0]


def _arch(spec, device: torch.device) -> Arch:
    if spec.target == "host":
        return Arch.host()
    if device.type != "cuda":
        raise ArgumentTypeError(f"dsv4jit: kernel {spec.name!r} runs on CUDA tensors, got device {device}")
    return loader.arch_for(device)


def variant(kernel: str, **params) -> Variant:
    """The variant of `kernel` that `function` loads: `pdl` defaults to on (every supported arch has
    programmatic dependent launch); DSV4JIT_DISABLE_PDL wins over callers (debugging)."""
    spec = SPECS[kernel]
    if spec.param("pdl") is not None:
        params = dict(params, pdl=params.get("pdl", True) and not env.disable_pdl())
    return spec.variant(**params)


def serving_variants(spec) -> list[Variant]:
    """The serving set of `spec` (what ``precompile`` builds by default) as `function` loads it, so
    that an image precompiled with the service's settings holds what its ops and `warmup` load."""
    return [variant(spec.name, **params) for params in spec.serving]


def function(kernel: str, name: str, device: torch.device, **params):
    """The exported function `name` of `kernel` built for `device` (its arch: devices may differ)."""
    key = (kernel, name, device, *params.items())  # callers pass params in a fixed order
    fn = _FUNCTIONS.get(key)
    if fn is None:
        arch = _arch(SPECS[kernel], device)
        module = loader.load(variant(kernel, **params), arch)
        fn = _FUNCTIONS[key] = getattr(module, name)
    return fn


def kernels_allocate() -> bool:
    """Whether kernel calls may allocate their outputs through tvm-ffi's environment allocator
    (torch's caching allocator). It needs torch's DLPack C exchange API (recent torch has it;
    tvm-ffi installs an addon into older torch when it can); without it the wrappers allocate."""
    if not _kernel_allocation:
        import tvm_ffi  # noqa: F401  (importing it installs the exchange API into older torch if it can)

        _kernel_allocation.append(hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
    return _kernel_allocation[0]


def status_word(device: torch.device, words: int = 1) -> torch.Tensor | None:
    """The int32 word(s) a kernel ORs data-dependent violations into, in checked mode only."""
    return torch.zeros(words, dtype=torch.int32, device=device) if checks_enabled() else None


def raise_status(status: torch.Tensor | None, op: str, kernel: str, device: torch.device, params: dict,
                 describe: tuple[str, ...] = ("describe_status",)) -> None:
    """Checked mode: sync, and raise ValueError if the kernel reported anything, in the words of the
    module that ran: export describe[i] of `kernel` (the variant of `params`) tells word i's bits."""
    if status is None:
        return
    words = status.tolist()
    if any(words):
        texts = [function(kernel, export, device, **params)(word) for export, word in zip(describe, words) if word]
        raise ArgumentError(f"dsv4jit.{op} (checked mode): {'; '.join(filter(None, texts))}")


@dataclass(frozen=True)
class SelfCheck:
    ok: bool
    detail: str  # what was loaded for which arch and how long it took, or what went wrong


def self_check(arch: Arch) -> SelfCheck:
    """Load (compiling on a miss) the trivial selftest kernel for `arch` as the ops would (the same PDL
    default), and when a GPU is visible run it and compare. A loader error fails the check."""
    try:
        selftest = variant("selftest", dtype="fp32")
        start = time.monotonic()
        module = loader.load(selftest, arch)
    except DSV4JITError as e:
        return SelfCheck(False, str(e))
    detail = f"{selftest.id} for {arch} loaded in {time.monotonic() - start:.2f}s"
    if not torch.cuda.is_available():
        return SelfCheck(True, detail + "; no GPU, not run")
    x = torch.randn(4096, device="cuda")
    out = torch.full_like(x, float("nan"))
    module.affine(x, out, 2.0, 1.0)
    torch.cuda.synchronize()
    if not torch.equal(out, x * 2.0 + 1.0):
        return SelfCheck(False, detail + "; GPU result mismatch")
    return SelfCheck(True, detail + "; ran on " + torch.cuda.get_device_name())
