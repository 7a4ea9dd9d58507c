"""From a torch device to a loaded kernel function: arch, PDL default, memo.

This is the only place the ops layer touches the loader; lookups after the first are one dict hit.
"""

from __future__ import annotations

import torch

from . import env
from .jit import loader
from .jit.kernels import SPECS
from .jit.toolchain import Arch

_FUNCTIONS: dict[tuple, object] = {}
_checks_override: list[bool] = []


def set_checks(enabled: bool | None) -> None:
    """Checked mode (data-dependent validation with a device sync); None restores DSV4JIT_CHECK."""
    _checks_override.clear()
    if enabled is not None:
        _checks_override.append(bool(enabled))


def checks_enabled() -> bool:
    return _checks_override[0] if _checks_override else env.checks()


def _arch(device: torch.device) -> Arch:
    return Arch.host() if device.type == "cpu" else loader.arch_for(device)


def function(kernel: str, name: str, device: torch.device, **params):
    """The exported function `name` of `kernel` built for `device`; `pdl` defaults to sm_90+."""
    key = (kernel, name, device.type, device.index, tuple(sorted(params.items())))
    fn = _FUNCTIONS.get(key)
    if fn is None:
        spec = SPECS[kernel]
        arch = _arch(device)
        if "pdl" in {p.name for p in spec.params} and "pdl" not in params:
            params = dict(params, pdl=arch.major >= 9 and not env.disable_pdl())
        module = loader.load(spec.variant(**params), arch)
        fn = _FUNCTIONS[key] = getattr(module, name)
    return fn
