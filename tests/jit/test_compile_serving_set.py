"""Every serving-set variant compiles for sm_90a and sm_100a (nvcc, no GPU needed) and its module
loads; the status texts of checked mode come from those modules.

Part of the full suite (``--full``): minutes of nvcc per arch. The sm_90a selftest and the CPU
planner, which the session has built already, are copied in rather than compiled again.
"""

from __future__ import annotations

import json

import pytest

from dsv4jit import cli
from dsv4jit.jit import loader
from dsv4jit.jit.kernels import SPECS
from dsv4jit.jit.toolchain import Arch
from dsv4jit.runtime import serving_variants
from helpers.jit_env import copy_entry

pytestmark = [pytest.mark.compile, pytest.mark.full, pytest.mark.usefixtures("jit_env")]


@pytest.mark.parametrize("arch", ["9.0a", "10.0a"])
def test_serving_set_compiles(arch, warm_cache, host_planner, cache_dir, capsys):
    copy_entry(cache_dir, host_planner)
    code = cli.main(["precompile", "--arch", arch, "-j", "2", "--keep-going", "--json"])
    report = json.loads(capsys.readouterr().out)
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert code == 0 and not failed, failed
    expected = {v.id for spec in SPECS.values() for v in serving_variants(spec)}
    assert {r["variant"] for r in report["results"]} == expected
    cached = {(r["variant"], r["arch"]) for r in report["results"] if r["status"] == "cached"}
    assert cached <= {("selftest[dtype=fp32,pdl=1]", "sm_90a"), ("plan_host", "host")}  # the rest compiled here
    check_status_texts({name: loader.load(serving_variants(SPECS[name])[0], Arch.parse(arch))
                        for name in (*STATUS_BITS, "fused", "fused_online")})


#: What each status bit of a family's kernels means, by words its text must contain (the StatusBit enums
#: of the headers): checked mode raises these texts, so each names the argument the caller got wrong.
STATUS_BITS = {
    "compress_c4": {1: "state page outside kv_score_buffer", 2: "ragged row outside kv_score_input",
                    4: "(write_loc) outside kv_score_buffer"},
    "compress_online": {1: "state row outside kv_score_buffer", 2: "ragged rows outside kv_score_input",
                        4: "segment_len is 0"},
    "store": {1: "out_loc entry", 2: "outside freq_cis", 4: "beyond out_loc"},
    "compat_c4": {1: "page outside kv_score_buffer", 2: "ragged row outside kv_score_input", 4: "batch_id",
                  8: "malformed row"},
}


def check_status_texts(modules: dict) -> None:
    """Each family's describe_status export (a host function: it runs without a GPU) tells every
    status bit, the bits set in bit order; the fused kernels tell their compressor's word and the
    store's with the same texts."""
    for name, bits in STATUS_BITS.items():
        describe = modules[name].describe_status
        texts = [describe(bit) for bit in bits]
        for (bit, words), text in zip(bits.items(), texts):
            assert words in text, (name, bit, text)
        assert describe(0) == ""
        assert describe(sum(bits) | 1 << 20) == "; ".join(texts)  # unknown bits add nothing
    for fused, compressor in (("fused", "compress_c4"), ("fused_online", "compress_online")):
        for bit in STATUS_BITS[compressor]:
            assert modules[fused].describe_compress_status(bit) == modules[compressor].describe_status(bit)
        for bit in STATUS_BITS["store"]:
            assert modules[fused].describe_store_status(bit) == modules["store"].describe_status(bit)

