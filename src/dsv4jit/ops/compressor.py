"""The two compressor kinds behind ``compress_forward`` and ``compress_and_store`` — the state ring
(c4 and c128, contract §4) and the online c128 state (contract §5) — as one descriptor each, and the
one code path over them: the kernel call (CUDA tensors), the torch reference (CPU tensors), and the
eager fast path's launcher.

A `Kind` says what differs: the checks a call must pass, the kernel variant and the exports it calls,
the rows per state page, the dtypes of ape and of the pooled rows, the wording of a head_dim the
tensors do not have, and the references. Everything else (plans, status words, output rows) is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from .. import runtime
from ..arguments import STATE_DTYPES
from ..errors import ArgumentError
from ..family import KernelChoice
from . import binding, checked, common


@dataclass(frozen=True)
class Kind:
    """One compressor kind. `check(op, plan, compress_ratio, head_dim, kv_score_input)` raises what
    the call cannot be; `kernel(ratio, head_dim, state, input, output)` picks the variant (dtype names);
    `rows_per_page(ratio)` and `width(head_dim, ratio)` shape the state pool for the references;
    `row_dtype(input dtype)` is the dtype of ape as the kernels read it and of the pooled rows;
    `widths(op, message, head_dim, ratio, buffer, input, ape)` explains a failed call whose rows do
    not have head_dim's width; `reference(buffer, input, ape, plan_rows, plan_w, head_dim, ratio, out)`
    runs the CPU path; `run_prefill(fn, buffer, input, ape, plan_rows, plan_w, out, status,
    reads_state)` is the call of the kind's prefill export (binding.calls)."""

    check: Callable[..., None]
    kernel: Callable[..., KernelChoice]
    rows_per_page: Callable[[int], int]
    width: Callable[[int, int], int]
    row_dtype: Callable[[torch.dtype], torch.dtype]
    widths: Callable[..., None]
    reference: Callable[..., None]
    run_prefill: Callable[..., None]

    def choice(self, op: str, compress_ratio: int, head_dim: int, state: torch.Tensor, kv_score_input: torch.Tensor,
               out: torch.Tensor) -> KernelChoice:
        """The variant a CUDA call runs (TypeError naming a tensor of a dtype no kernel has)."""
        return self.kernel(compress_ratio, head_dim, common.dtype_name(state, "kv_score_buffer", op, STATE_DTYPES),
                           common.dtype_name(kv_score_input, "kv_score_input", op), common.dtype_name(out, "out", op))


def run(kind: Kind, op: str, kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
        plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], out: torch.Tensor, head_dim: int,
        compress_ratio: int, is_decode: bool, reads_state: bool = True) -> None:
    """compress_forward of `kind` on unpacked plan tensors (plan_w: None in decode; reads_state: a
    prefill plan's, which the ring compressors' prefill takes)."""
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, out, plan_rows, plan_w)
    if device is None:
        buffer = common.state_pool(kv_score_buffer, kind.rows_per_page(compress_ratio),
                                   kind.width(head_dim, compress_ratio))
        kind.reference(buffer, kv_score_input, ape, plan_rows, plan_w, head_dim, compress_ratio, out)
        return
    name, params = kind.choice(op, compress_ratio, head_dim, kv_score_buffer, kv_score_input, out)
    fn = runtime.function(name, "decode" if is_decode else "prefill", device, **params)
    status = runtime.status_word(device)
    if status is not None:
        checked.compressor(op, kv_score_input, ape, plan_rows, plan_w, head_dim, compress_ratio)
    if is_decode:
        run_decode(fn, kv_score_buffer, kv_score_input, ape, plan_rows, out, status)
    else:
        kind.run_prefill(fn, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status, reads_state)
    runtime.raise_status(status, op, name, device, params)


@binding.calls(("compress_c4", "compress_c128", "compress_online"), "decode")
def run_decode(fn, kv_score_buffer, kv_score_input, ape, plan_rows, out, status) -> None:
    fn(kv_score_buffer, kv_score_input, ape, plan_rows, out, status)


def launcher(fn, kind: Kind, compress_ratio: int, head_dim: int, decode: bool, ape_dtype: Optional[torch.dtype],
             out_dtype: Optional[torch.dtype]) -> Callable:
    """The eager fast path's call of a resolved signature: `fn` the kernel export, `ape_dtype` the dtype
    ape is converted to (None: passed as it is), `out_dtype` that of an allocated output (None: the
    input's, allocated by new_empty, which parses no keywords). It raises (before any launch) what the
    full path then explains."""

    def launch(kv_score_buffer, kv_score_input, ape, plan, out):
        if plan.compress_ratio != compress_ratio:
            raise ArgumentError("plan of another compress ratio")
        if ape_dtype is not None:
            ape = ape.to(ape_dtype)
        rows = plan.plan_rows
        if out is None:
            out = (kv_score_input.new_empty((rows.shape[0], head_dim)) if out_dtype is None else
                   torch.empty((rows.shape[0], head_dim), dtype=out_dtype, device=kv_score_input.device))
        if decode:
            run_decode(fn, kv_score_buffer, kv_score_input, ape, rows, out, None)
        else:
            kind.run_prefill(fn, kv_score_buffer, kv_score_input, ape, rows, plan.plan_w, out, None, plan.reads_state)
        return out

    return launch
