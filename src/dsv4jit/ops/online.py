"""The online c128 compressor (contract §5) as a compressor kind (ops/compressor.py): what
``compress_forward(..., is_online=True)`` and ``compress_and_store(..., is_online=True)`` check and run.

Each request keeps one running softmax state row (m | s | k, ``3·head_dim`` values, fp32 or bf16)
instead of a 128-row ring; plans come from ``CompressorPrefillPlan.generate_online`` /
``CompressorDecodePlan.generate_online``. Input, ape and output are fp32. CUDA tensors run
csrc/compress/online.cuh, CPU tensors reference/online.py.
"""

from __future__ import annotations

import torch

from .. import library
from ..errors import ArgumentError, ArgumentTypeError
from ..family import Family, KernelChoice
from ..geometry import CHUNK, online_input_width, online_state_width
from ..jit.kernels import COMPRESS_ONLINE
from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from ..reference import online as ref_online
from . import binding, common, compressor

_OP = "compress_forward"
RATIO = CHUNK  # one compressed row per 128-token chunk: the online compressor is c128
_KERNEL_HEAD_DIMS = COMPRESS_ONLINE.param("head_dim").choices


def kernel(head_dim: int, state: str) -> KernelChoice:
    """The variant a call runs (state by kernel dtype name: ``fp32``, ``bf16``)."""
    return "compress_online", {"head_dim": head_dim, "state": state}


FAMILY = Family("online", lambda cfg: [kernel(hd, cfg.state) for hd in cfg.head_dims.get(RATIO, ())])


def check_online(op: str, plan: CompressorPrefillPlan | CompressorDecodePlan, compress_ratio: int, head_dim: int,
                 kv_score_input: torch.Tensor) -> None:
    """What is_online=True requires of the ratio, the plan, head_dim and the input dtype."""
    if compress_ratio != RATIO:
        raise ArgumentError(f"dsv4jit.{op}: argument 'compress_ratio' must be 128 with is_online=True, "
                            f"got {compress_ratio}")
    if plan.compress_ratio != RATIO:
        raise ArgumentError(f"dsv4jit.{op}: argument 'plan' must be an online (compress_ratio 128) plan, "
                            f"got compress_ratio {plan.compress_ratio}")
    if head_dim <= 0 or head_dim % 128:
        raise ArgumentError(f"dsv4jit.{op}: argument 'head_dim' must be a positive multiple of 128 with "
                            f"is_online=True, got {head_dim}")
    if not plan.is_decode and plan.plan_w.shape[-1] != 16:
        raise ArgumentError(f"dsv4jit.{op}: argument 'plan' must come from generate_online (16-byte plan_w rows), "
                            f"got plan_w of shape {list(plan.plan_w.shape)}")
    if kv_score_input.dtype != torch.float32:
        raise ArgumentTypeError(f"dsv4jit.{op}: argument 'kv_score_input': dtype must be float32 with is_online=True, "
                                f"got {kv_score_input.dtype}")


def _kernel(compress_ratio: int, head_dim: int, state: str, input: str, output: str) -> KernelChoice:
    if head_dim not in _KERNEL_HEAD_DIMS:
        raise ArgumentError(f"dsv4jit.{_OP}: argument 'head_dim' must be one of {list(_KERNEL_HEAD_DIMS)} on CUDA "
                            f"with is_online=True, got {head_dim}")
    return kernel(head_dim, state)  # input and output are fp32, which the kernel checks


def online_widths(op: str, message: str, head_dim: int, compress_ratio: int, kv_score_buffer, kv_score_input,
                  ape) -> None:
    """After a failed call: ValueError naming head_dim when the state or input rows do not have its width."""
    common.check_widths(op, message, head_dim, "in the online compressor",
                        {"kv_score_buffer": (kv_score_buffer, online_state_width(head_dim)),
                         "kv_score_input": (kv_score_input, online_input_width(head_dim)), "ape": (ape, head_dim)})


def _reference(buffer, inputs, ape, plan_rows, plan_w, head_dim, compress_ratio, out) -> None:
    if plan_w is None:
        ref_online.online_decode(buffer, inputs, ape, plan_rows, head_dim=head_dim, out=out)
    else:
        ref_online.online_prefill(buffer, inputs, ape, plan_rows, plan_w, head_dim=head_dim, out=out)


@binding.calls(("compress_online",), "prefill", unbound=("reads_state",))
def run_prefill(fn, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status, reads_state) -> None:
    """An online prefill folds each segment into its request's state row: reads_state is not the kernel's."""
    fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status)


KIND = compressor.Kind(
    check=check_online, kernel=_kernel, rows_per_page=lambda ratio: 1,
    width=lambda head_dim, ratio: online_state_width(head_dim), row_dtype=lambda input_dtype: torch.float32,
    widths=online_widths, reference=_reference, run_prefill=run_prefill)


@library.custom_op("compress_online", mutates_args=("kv_score_buffer", "out"))
def online_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
              plan_rows: torch.Tensor, plan_w: torch.Tensor | None, out: torch.Tensor, head_dim: int,
              is_decode: bool) -> None:
    """compress_forward(is_online=True) on unpacked plan tensors (plan_rows: plan_c or plan_d; plan_w:
    None in decode)."""
    compressor.run(KIND, _OP, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, head_dim, RATIO, is_decode)
