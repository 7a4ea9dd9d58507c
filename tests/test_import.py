"""Importing dsv4jit is cheap and inert: no CUDA, no tvm-ffi, no subprocess, no compile, no cache writes.

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
t = time.perf_counter()
for name in sys.argv[1:]:
    __import__(name)
seconds = time.perf_counter() - t
torch = sys.modules.get("torch")
print(json.dumps({
    "seconds": seconds,
    "spawned": spawned,
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
def test_import_is_inert(modules, tmp_path, capsys):
    cache_dir = tmp_path / "import-cache"
    report = probe(modules, cache_dir)
    assert report["spawned"] == []  # no nvcc --version, no nvidia-smi
    assert report["tvm_ffi"] is False
    assert report["cuda_initialized"] is False
    assert not cache_dir.exists()  # nothing compiled, nothing written
    with capsys.disabled():
        print(f"\n[import] {', '.join(modules)}: {report['seconds'] * 1e3:.1f} ms "
              f"(torch imported: {report['torch']})")


def test_import_time_of_the_package(tmp_path, capsys):
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import dsv4jit"], capture_output=True,
                         text=True, timeout=120, env=fresh_env(tmp_path / "import-cache"))
    assert res.returncode == 0, res.stderr
    # Lines look like "import time:   self [us] | cumulative | imported package".
    rows = {}
    for line in res.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
            rows[name] = int(cumulative)
    assert "dsv4jit" in rows, res.stderr[-2000:]
    assert not any(name.split(".")[0] in ("torch", "tvm_ffi", "filelock") for name in rows)
    seconds = rows["dsv4jit"] / 1e6
    with capsys.disabled():
        print(f"\n[import] python -X importtime: dsv4jit cumulative {seconds * 1e3:.2f} ms")
    assert seconds < 0.5
    assert probe(["dsv4jit"], tmp_path / "import-cache")["seconds"] < 0.5
