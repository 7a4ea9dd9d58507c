"""The CUDA kernels a call launches, by name, from a torch.profiler trace (CUPTI)."""

from __future__ import annotations

import torch


def dsv4jit_kernels(call, namespace: str = "dsv4::") -> list[str]:
    """Names of the kernels of `namespace` that `call()` launched, in launch order (the GPU
    synchronized before and after, so that the trace holds exactly the call's kernels)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and namespace in e.name]
    return [e.name for e in sorted(kernels, key=lambda e: e.time_range.start)]
