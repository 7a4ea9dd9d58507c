"""dsv4jit.warmup: the variants a configuration reaches, built in parallel and loaded, so that the ops
afterwards never compile or load a module (checked on a GPU by forbidding loads after the warm-up).

CPU tests that build use their own kernel cache (the ``jit_env`` fixture of conftest.py); the GPU
test uses the default cache and needs no conftest.
"""

from __future__ import annotations

import json

import pytest
import torch

import dsv4jit
from dsv4jit import cli, runtime
from dsv4jit.jit import loader
from dsv4jit.jit.kernels import SPECS
from dsv4jit.jit.toolchain import SUPPORTED_ARCHS, Arch
from dsv4jit.preload import FAMILIES, variants
from helpers.jit_env import copy_entry

HAS_CUDA = torch.cuda.is_available()
SM90 = Arch.parse("9.0a")


def ids(vs) -> list[str]:
    return [v.id for v in vs]


#: DeepSeek-V4 as docs/contract.md states it (contract §1.6): compress ratio -> the head dims of its
#: compressors (the 512-dim core latent on both ratios, the 128-dim indexer keys on c4 layers), fp32
#: state; and the store format of each head dim when neither use_fp4 nor bf16_store is given
#: (contract §6.5).
MODEL_HEAD_DIMS = {4: (512, 128), 128: (512,)}
DEFAULT_FORMAT = {512: "v4_fp8", 128: "indexer_fp8"}


def test_model_defaults_reach_the_models_planner_compressors_and_stores():
    fp32 = {"state": "fp32", "input": "fp32", "output": "fp32"}
    expect = [("plan", {})]
    expect += [(f"compress_c{ratio}", {"head_dim": hd, **fp32}) for ratio, hds in MODEL_HEAD_DIMS.items()
               for hd in hds]
    # one store variant per format: the c4 and c128 latents share v4_fp8
    formats = dict.fromkeys(DEFAULT_FORMAT[hd] for hds in MODEL_HEAD_DIMS.values() for hd in hds)
    expect += [("store", {"dtype": "fp32", "format": fmt}) for fmt in formats]
    got = [(v.spec.name, frozenset(v.params.items())) for v in variants(SM90)]
    assert len(set(got)) == len(got)
    # every variant for sm_90a launches with PDL
    assert set(got) == {(name, frozenset({**params, "pdl": True}.items())) for name, params in expect}


def test_dtypes_formats_and_op_families():
    got = ids(variants(SM90, state_dtype=torch.bfloat16, input_dtype=torch.bfloat16, output_dtype=torch.float32,
                       use_fp4=True, bf16_store=True,
                       ops=("compress", "store", "fused", "online", "fused_online")))
    assert got == [
        "compress_c4[head_dim=512,state=bf16,input=bf16,output=fp32,pdl=1]",
        "compress_c4[head_dim=128,state=bf16,input=bf16,output=fp32,pdl=1]",
        "compress_c128[head_dim=512,state=bf16,input=bf16,output=fp32,pdl=1]",
        "store[dtype=fp32,format=v4_bf16,pdl=1]",
        "store[dtype=fp32,format=indexer_fp4,pdl=1]",
        "fused[ratio=4,format=v4_bf16,state=bf16,input=bf16,pdl=1]",
        "fused[ratio=4,format=indexer_fp4,state=bf16,input=bf16,pdl=1]",
        "fused[ratio=128,format=v4_bf16,state=bf16,input=bf16,pdl=1]",
        "compress_online[head_dim=512,state=bf16,pdl=1]",
        "fused_online[format=v4_bf16,state=bf16,pdl=1]",
    ]


def test_compat_reaches_the_c4_head_dims():
    assert ids(variants(SM90, state_dtype=torch.bfloat16, head_dims={4: (128,), 128: (512,)}, ops=("compat",))) == [
        "compat_c4[head_dim=128,state=bf16,input=fp32,output=fp32,pdl=1]"]


def test_every_kernel_module_is_reached_by_a_family():
    """A kernel added to the catalogue without a family in preload.FAMILIES could not be warmed up."""
    reached = {v.spec.name for arch in (SM90, Arch.host()) for v in variants(arch, ops=tuple(FAMILIES))}
    reached |= {v.spec.name for v in variants(SM90, ops=tuple(FAMILIES), head_dims={1: (512,), 2: (512,)})}
    assert reached == set(SPECS) - {"selftest", "store_probes"}  # the toolchain check and the test-only probes


def test_pdl_follows_the_kill_switch(monkeypatch):
    assert ids(variants(SM90, ops=("plan",))) == ["plan[pdl=1]"]
    monkeypatch.setenv("DSV4JIT_DISABLE_PDL", "1")
    assert ids(variants(SM90, ops=("plan",))) == ["plan[pdl=0]"]


def test_variants_take_the_arch_as_warmup_does():
    assert variants("9.0a") == variants(SM90) == variants("sm_90a")
    assert ids(variants("10.0", ops=("plan",))) == ["plan[pdl=1]"]
    with pytest.raises(ValueError, match=r"dsv4jit.warmup: argument 'arch': unsupported CUDA arch '8.0' \(sm_80\)"):
        variants("8.0")


#: The configurations the serving set stands for, as warmup takes them: DeepSeek-V4 through every op
#: family with the default formats and the fp4 indexer, bf16 state pools, and the bf16 latent cache.
SERVING_CONFIGS = (dict(ops=tuple(FAMILIES)), dict(ops=tuple(FAMILIES), use_fp4=True),
                   dict(ops=("compress", "online", "fused_online", "online_mtp"), state_dtype=torch.bfloat16),
                   dict(ops=("store",), bf16_store=True),
                   dict(ops=("store", "fused", "c4_layer"), layout={4: "v41", 128: "v41"}),
                   dict(ops=("c4_layer",), layout={4: "v41"}, use_fp4=True),
                   dict(ops=("low_ratio", "c2_decode_pool"), head_dims={1: (512,), 2: (512,)},
                        layout={1: "v41_fp4", 2: "v41_fp4"}),
                   dict(ops=("low_ratio",), head_dims={1: (512,), 2: (512,)}))


@pytest.mark.usefixtures("jit_env")
@pytest.mark.parametrize("pdl_setting", [None, "1"], ids=["pdl default", "DSV4JIT_DISABLE_PDL=1"])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_precompile_builds_what_warmup_and_the_ops_load(arch, pdl_setting, monkeypatch, capsys):
    """An image precompiled for an arch holds exactly the variants warmup and the ops load there
    for the serving configurations (plus the toolchain check's), launch options (pdl) included.
    ``list`` selects as ``precompile`` does, and needs no compiler."""
    if pdl_setting:
        monkeypatch.setenv("DSV4JIT_DISABLE_PDL", pdl_setting)
    assert cli.main(["list", "--arch", arch, "--json"]) == 0
    built = {r["variant"] for r in json.loads(capsys.readouterr().out)["variants"] if r["arch"] == arch}
    loaded = {v.id for config in SERVING_CONFIGS for v in variants(arch, **config)}
    assert built == loaded | {runtime.variant("selftest", dtype="fp32").id}


def test_host_target_reaches_the_cpu_planner_only():
    assert ids(variants(Arch.host())) == ["plan_host"]
    assert variants(Arch.host(), ops=("compress",)) == []


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="'ops'.*bogus"):
        variants(SM90, ops=("compress", "bogus"))
    with pytest.raises(TypeError, match="'state_dtype'"):
        variants(SM90, state_dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim"):
        variants(SM90, head_dims={4: (256,)})  # compress has hd 256, the store does not


def test_import_stays_lazy():
    assert callable(dsv4jit.warmup)
    assert "warmup" in dir(dsv4jit)


def test_cpu_warmup_loads_the_host_planner(monkeypatch, cache_dir, host_planner):
    copy_entry(cache_dir, host_planner)  # built once per session (building is tested below, for a GPU arch)
    monkeypatch.setattr(runtime, "_FUNCTIONS", {})
    assert dsv4jit.warmup("cpu") == ["plan_host"]
    monkeypatch.setattr(loader, "_load_uncached", lambda *a: pytest.fail("loaded after warmup"))
    runtime.function("plan_host", "prefill", torch.device("cpu"))


@pytest.mark.compile
@pytest.mark.usefixtures("jit_env")
def test_gpu_less_warmup_builds_for_an_arch(monkeypatch):
    """No GPU needed with an explicit arch: the variant lands in the cache and loads from it."""
    built = dsv4jit.warmup(arch="9.0a", head_dims={128: (64,)}, ops=("compress",), jobs=1)
    assert built == ["compress_c128[head_dim=64,state=fp32,input=fp32,output=fp32,pdl=1]"]
    loader.clear_memo()
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    (variant,) = variants(SM90, head_dims={128: (64,)}, ops=("compress",))
    assert loader.resolve(variant, SM90).entry is not None
    module = loader.load(variant, SM90)
    assert hasattr(module, "decode")
    assert module.describe_status(2) == "a plan row names a ragged row outside kv_score_input"  # runs on the host


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_after_warmup_the_ops_load_nothing(monkeypatch):
    from helpers.compressor_step import make_step, run

    runtime._FUNCTIONS.clear()
    loader.clear_memo()
    dsv4jit.warmup()
    monkeypatch.setattr(loader, "_load_uncached", lambda v, a: pytest.fail(f"{v.id} loaded after warmup"))
    for ratio, hd in ((4, 512), (4, 128), (128, 512)):
        for decode in (False, True):
            run(make_step("cuda", ratio=ratio, head_dim=hd, decode=decode, lengths_on_device=False))
        run(make_step("cuda", ratio=ratio, head_dim=hd, lengths_on_device=True))
    torch.cuda.synchronize()
