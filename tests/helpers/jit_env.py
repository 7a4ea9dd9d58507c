"""What conftest.py's fixtures and the loader and CLI tests share: the real nvcc (or why there is
none), the target and the selftest variant the session cache holds, the version text of the
stand-in nvcc, and readers of a cache root."""

from __future__ import annotations

import shutil
from pathlib import Path

from dsv4jit.errors import DSV4JITToolchainError
from dsv4jit.jit import cache, toolchain

ARCH_TEXT = "9.0a"
SELFTEST_ID = "selftest[dtype=fp32,pdl=1]"
DEFAULT_VERSION = ("nvcc: NVIDIA (R) Cuda compiler driver\n"
                   "Cuda compilation tools, release 13.0, V13.0.88 (fake)")


def _find_real_nvcc() -> tuple[str | None, str]:
    """The toolkit's nvcc, found as the package finds it (jit/toolchain.py: DSV4JIT_NVCC, CUDA_HOME,
    CUDA_PATH, PATH, /usr/local/cuda, resolved through wrappers); else None and why."""
    try:
        return str(toolchain.toolchain(need_cuda=True).nvcc), ""
    except DSV4JITToolchainError as e:
        return None, f"needs the CUDA compiler: {e}"
    finally:
        toolchain.reset()


REAL_NVCC, NO_NVCC_REASON = _find_real_nvcc()


def copy_entry(root: Path, entry: Path) -> Path:
    """A copy of a cache entry in another cache root, at the same place (v1/<arch>/<kernel>/<entry>)."""
    copy = root / entry.relative_to(entry.parents[3])
    shutil.copytree(entry, copy)
    return copy


def entries_on_disk(root: Path) -> list[Path]:
    """Complete entries (folders with a manifest) under a cache root."""
    found = root.glob(f"v{cache.SCHEMA}/*/*/*/manifest.json")
    return sorted(p.parent for p in found if not p.parent.name.startswith("."))


def stages_on_disk(root: Path) -> list[Path]:
    return sorted(root.glob(f"v{cache.SCHEMA}/*/*/.stage-*"))
