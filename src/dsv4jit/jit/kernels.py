"""The catalogue: every kernel module dsv4jit can build, with its default serving set."""

from __future__ import annotations

from .registry import KernelSpec, Param

PDL = Param("pdl", "bool", (False, True))

SELFTEST = KernelSpec(
    name="selftest",
    header="selftest.cuh",
    params=(Param("dtype", "dtype", ("fp32", "bf16")), PDL),
    exports={"affine": "dsv4::SelfTest<{dtype}, {pdl}>::affine"},
    serving=({"dtype": "fp32", "pdl": True},),
    doc="out = x * alpha + beta; toolchain and loader checks",
)

PLAN = KernelSpec(
    name="plan",
    header="plan.cuh",
    params=(PDL,),
    exports={"prefill_device": "dsv4::plan::Planner<{pdl}>::prefill_device",
             "prefill_host_lengths": "dsv4::plan::Planner<{pdl}>::prefill_host_lengths",
             "decode": "dsv4::plan::Planner<{pdl}>::decode",
             "describe_status": "dsv4::plan::describe_status"},
    serving=({"pdl": True}, {"pdl": False}),
    doc="compress/write/decode plans from device- or host-resident lengths",
)

PLAN_HOST = KernelSpec(
    name="plan_host",
    header="plan_host.h",
    params=(),
    exports={"prefill": "dsv4::plan::HostPlanner::prefill", "decode": "dsv4::plan::HostPlanner::decode",
             "describe_status": "dsv4::plan::describe_status"},
    serving=({},),
    target="host",
    doc="the planner on the CPU (all inputs and plans on the host)",
)

SPECS: dict[str, KernelSpec] = {s.name: s for s in (SELFTEST, PLAN, PLAN_HOST)}
