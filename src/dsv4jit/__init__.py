"""dsv4jit: JIT-compiled CUDA kernels for the DeepSeek-V4 KV compressor.

Importing the package is cheap: torch, tvm-ffi and the kernels load on first use of a public name.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (resolved lazily, so `import dsv4jit` stays inert)
_EXPORTS = {
    "CompressorPrefillPlan": "dsv4jit.plan",
    "CompressorDecodePlan": "dsv4jit.plan",
    "KVLayout": "dsv4jit.kv_layout",
    "c1_decode_norm_rope_store": "dsv4jit.ops",
    "c2_decode_norm_rope_store": "dsv4jit.ops",
    "c2_decode_pool": "dsv4jit.ops",
    "c2_prefill_norm_rope_store": "dsv4jit.ops",
    "compress_forward": "dsv4jit.ops",
    "compress_and_store": "dsv4jit.ops",
    "compress_and_store_c4_layer": "dsv4jit.ops",
    "compress_norm_rope_store": "dsv4jit.ops",
    "is_valid_kv_layout_pair": "dsv4jit.kv_layout",
    "low_ratio_metadata": "dsv4jit.token_metadata",
    "online_c128_mtp_commit_pending": "dsv4jit.ops",
    "online_c128_mtp_mark_pending": "dsv4jit.ops",
    "online_c128_mtp_write_prefix_states": "dsv4jit.ops",
    "set_checks": "dsv4jit.runtime",
    "warmup": "dsv4jit.preload",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dsv4jit' has no attribute {name!r}")


def __dir__():
    return __all__
