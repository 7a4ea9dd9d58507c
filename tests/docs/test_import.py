"""Importing dsv4jit is cheap and inert: no CUDA, no tvm-ffi, no subprocess, no compile, no cache writes,
and the package itself loads no library outside Python's own (counted, not timed: a time limit
would fail on a loaded machine and pass a slow import on a fast one).

Each check runs in a fresh interpreter, since this test process has long imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("jit_env")

PROBE = """
import json, subprocess, sys, time
spawned = []
_init = subprocess.Popen.__init__
def _recording_init(self, args, *rest, **kwargs):
    spawned.append(repr(args)[:200])
    return _init(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = _recording_init
before = set(sys.modules)
t = time.perf_counter()
for name in sys.argv[1:]:
    __import__(name)
seconds = time.perf_counter() - t
torch = sys.modules.get("torch")
print(json.dumps({
    "seconds": seconds,
    "spawned": spawned,
    "packages": sorted({m.split(".")[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)),
    "tvm_ffi": "tvm_ffi" in sys.modules,
    "torch": torch is not None,
    "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
}))
"""


def fresh_env(cache_dir) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4JIT_")}
    env["DSV4JIT_CACHE_DIR"] = str(cache_dir)
    return env


def probe(modules: list[str], cache_dir) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120,
                         env=fresh_env(cache_dir))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("modules", [["dsv4jit"], ["dsv4jit.jit.loader", "dsv4jit.cli"]],
                         ids=["package", "loader and cli"])
def test_import_is_inert(modules, tmp_path, record_property):
    cache_dir = tmp_path / "import-cache"
    report = probe(modules, cache_dir)
    assert report["spawned"] == []  # no nvcc --version, no nvidia-smi
    assert report["tvm_ffi"] is False
    assert report["cuda_initialized"] is False
    assert not cache_dir.exists()  # nothing compiled, nothing written
    record_property("measured", f"import {', '.join(modules)}: {report['seconds'] * 1e3:.1f} ms "
                                f"(torch imported: {report['torch']})")


def test_the_package_loads_nothing_outside_the_standard_library(tmp_path):
    # torch, tvm_ffi, filelock and numpy load when an op, the loader or the CLI first needs them
    assert probe(["dsv4jit"], tmp_path / "import-cache")["packages"] == ["dsv4jit"]
