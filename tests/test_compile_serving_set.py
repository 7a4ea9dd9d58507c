"""Every serving-set variant compiles for sm_90a (nvcc, no GPU needed) and its module loads."""

from __future__ import annotations

import json

import pytest

from conftest import REAL_NVCC
from dsv4jit import cli
from dsv4jit.jit.kernels import SPECS

pytestmark = pytest.mark.compile


@pytest.mark.skipif(REAL_NVCC is None, reason="needs the CUDA compiler (nvcc)")
def test_serving_set_compiles_for_sm90(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV4JIT_CACHE_DIR", str(tmp_path / "cache"))
    code = cli.main(["precompile", "--arch", "9.0a", "-j", "2", "--keep-going", "--json"])
    report = json.loads(capsys.readouterr().out)
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert code == 0 and not failed, failed
    expected = {v.id for spec in SPECS.values() for v in spec.serving_variants()}
    assert {r["variant"] for r in report["results"]} == expected
