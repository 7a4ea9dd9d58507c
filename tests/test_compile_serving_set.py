"""Every serving-set variant compiles for sm_90a (nvcc, no GPU needed) and its module loads.

Part of the full suite (``--full``): minutes of nvcc. The selftest and the CPU planner, which the
session has built already, are copied in rather than compiled again.
"""

from __future__ import annotations

import json

import pytest

from conftest import copy_entry
from dsv4jit import cli
from dsv4jit.jit.kernels import SPECS

pytestmark = [pytest.mark.compile, pytest.mark.full, pytest.mark.usefixtures("jit_env")]


def test_serving_set_compiles_for_sm90(warm_cache, host_planner, cache_dir, capsys):
    copy_entry(cache_dir, host_planner)
    code = cli.main(["precompile", "--arch", "9.0a", "-j", "2", "--keep-going", "--json"])
    report = json.loads(capsys.readouterr().out)
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert code == 0 and not failed, failed
    expected = {v.id for spec in SPECS.values() for v in spec.serving_variants()}
    assert {r["variant"] for r in report["results"]} == expected
    cached = {r["variant"] for r in report["results"] if r["status"] == "cached"}
    assert cached <= {"selftest[dtype=fp32,pdl=1]", "plan_host"}  # everything else was compiled here
