"""``python -m dsv4jit demo``: the compressor kernels driven the way a serving stack drives them.

A paged KV pool, requests with random prompts, chunked prefill steps and decode steps (captured in a
CUDA graph on a GPU) through the compressors of DeepSeek-V4 layers; the final state rings and
compressed caches are compared with the same flow on the torch reference backend.

Modules: ``pool`` (pool, requests, schedule), ``layer`` (compressors and the per-layer ``step``),
``engine`` (one backend's tensors, plans per step, the decode graph), ``check`` (comparison),
``run`` (driver, timing, report); ``speculative`` (online c128 verify steps) and ``v41``
(DeepSeek-V4.1's ratios 1, 2, 4 and 128 with V4.1 layouts) are the other flows.
"""

from .run import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    DemoConfig,
    DemoResult,
    format_result,
    run_demo,
)

__all__ = ["CPU_DEFAULTS", "GPU_DEFAULTS", "DemoConfig", "DemoResult", "format_result", "run_demo"]
