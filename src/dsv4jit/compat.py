"""The older c4 compress entry points (contract §7), kept for callers of that interface.

``flash_c4_decode`` / ``flash_c4_prefill`` take the arguments of the older kernel's run_decode /
run_prefill, in the same order: requests are addressed by ``indices`` (int32, one per request) and,
in decode, ``seq_lens`` (int32); the optional ``extra`` tensor selects the 4-aligned paged mode
(``kv_score_buffer [num_pages, 4, 4·hd]``) instead of one 8-row ring per request
(``[num_indices, 8, 4·hd]``). Prefill plans are ``uint8 [rows, 16]`` rows of the older PrefillPlan
``{ragged_id, batch_id, position, window_len}`` (``dsv4jit.reference.compat.encode_legacy_plan``)
and the output is indexed by ragged id. See ``dsv4jit.reference.compat`` for the exact semantics.

CUDA tensors run the kernels (csrc/compat/compat_c4.cuh, built on the main c4 kernel's device code); all-CPU
tensors run the torch reference; a CPU/CUDA mix raises TypeError naming the argument on the CPU.
head_dim (128 or 512) is ``kv_compressed_output.shape[1]``. Differences from the older kernel: the
state may be bf16 while the input is fp32 (inputs and outputs fp32, bf16 or fp16), decode rows off a
compress boundary are zero-filled, the masked first-window slots are never read, and every entry a
plan or index names is range-checked (checked mode reports a skipped row as ValueError).
"""

from __future__ import annotations

import torch

from . import runtime
from .arguments import FLOAT_DTYPES, STATE_DTYPES, TensorCheck, reworded, tensors
from .errors import ArgumentError
from .family import Family, KernelChoice
from .jit.kernels import COMPAT_C4
from .ops import checked
from .ops.common import cuda_device, dtype_name
from .plan_layout import LEGACY_PLAN_BYTES
from .reference import compat as ref

__all__ = ["flash_c4_decode", "flash_c4_prefill"]

_DECODE, _PREFILL = "flash_c4_decode", "flash_c4_prefill"
_HEAD_DIMS = COMPAT_C4.param("head_dim").choices


def kernel(head_dim: int, state: str, input: str, output: str) -> KernelChoice:
    """The variant a call runs (dtypes by kernel name: ``fp32``, ``bf16``, ``fp16``)."""
    return "compat_c4", {"head_dim": head_dim, "state": state, "input": input, "output": output}


FAMILY = Family("compat", lambda cfg: [kernel(hd, cfg.state, cfg.input, cfg.output) for hd in cfg.head_dims.get(4, ())])


def _head_dim(op: str, out: torch.Tensor) -> int:
    if out.dim() != 2 or out.shape[1] not in _HEAD_DIMS:
        raise ArgumentError(f"dsv4jit.{op}: argument 'kv_compressed_output' must be [rows, head_dim] with head_dim "
                            f"128 or 512, got shape {list(out.shape)}")
    return out.shape[1]


def _check_common(check: TensorCheck, hd: int, paged: bool, buffer, inputs, out, ape, indices, rows: str) -> None:
    check("kv_score_buffer", buffer, ("num_pages" if paged else "num_indices", 4 if paged else 8, 4 * hd),
          STATE_DTYPES)
    check("kv_score_input", inputs, (rows, 4 * hd), FLOAT_DTYPES)
    check("kv_compressed_output", out, (rows, hd), FLOAT_DTYPES)
    check("ape", ape, (8, hd), (inputs.dtype,))
    check("indices", indices, ("batch_size",), (torch.int32,), align=4)


def _kernel(op: str, hd: int, buffer, inputs, out) -> KernelChoice:
    return kernel(hd, dtype_name(buffer, "kv_score_buffer", op, STATE_DTYPES), dtype_name(inputs, "kv_score_input", op),
                  dtype_name(out, "kv_compressed_output", op))


def _run(op: str, device: torch.device, export: str, choice: KernelChoice, *args) -> None:
    """Calls the kernel, then raises what checked mode found."""
    name, params = choice
    status = runtime.status_word(device)
    runtime.function(name, export, device, **params)(*args, status)
    runtime.raise_status(status, op, name, device, params)


def flash_c4_decode(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor,
                    kv_compressed_output: torch.Tensor, ape: torch.Tensor, indices: torch.Tensor,
                    seq_lens: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step: store each request's token, pool the window of requests at a compress boundary.

    kv_score_buffer: ring ``[num_indices, 8, 4·hd]`` or, with ``extra``, pages ``[num_pages, 4, 4·hd]``
    (fp32 or bf16; updated in place). kv_score_input ``[B, 4·hd]``; kv_compressed_output ``[B, hd]``
    (rows without an event are zeroed); ape ``[8, hd]`` in the input dtype; indices, seq_lens int32
    ``[B]`` (seq_lens >= 1: length including this token); extra int32 ``[B, 1]``: overlap pages.
    Returns kv_compressed_output.
    """
    op = _DECODE
    tensors(op, dict(kv_score_buffer=kv_score_buffer, kv_score_input=kv_score_input,
                     kv_compressed_output=kv_compressed_output, ape=ape, indices=indices, seq_lens=seq_lens,
                     extra=extra), ("extra",))
    hd = _head_dim(op, kv_compressed_output)
    device = cuda_device(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra)
    if device is None:
        check = TensorCheck(op)
        _check_common(check, hd, extra is not None, kv_score_buffer, kv_score_input, kv_compressed_output, ape,
                      indices, "batch_size")
        check("seq_lens", seq_lens, ("batch_size",), (torch.int32,), align=4)
        if extra is not None:
            check("extra", extra, ("batch_size", 1), (torch.int32,), align=4)
        try:
            return ref.c4_decode(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra)
        except (ValueError, TypeError) as e:  # the reference names its argument: add the function's name
            raise reworded(op, e, locals()) from None
    if runtime.checks_enabled():
        checked.inputs(op, kv_score_input=kv_score_input, ape=ape)
    _run(op, device, "decode", _kernel(op, hd, kv_score_buffer, kv_score_input, kv_compressed_output),
         kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra)
    return kv_compressed_output


def flash_c4_prefill(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor,
                     kv_compressed_output: torch.Tensor, ape: torch.Tensor, indices: torch.Tensor,
                     compress_plan: torch.Tensor, write_plan: torch.Tensor,
                     extra: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill step: pool every compress row (into output row ragged_id), then store every write row.

    kv_score_buffer as in :func:`flash_c4_decode`; kv_score_input ``[num_q_tokens, 4·hd]`` (ragged);
    kv_compressed_output ``[num_q_tokens, hd]`` (rows no compress row names are left untouched);
    indices int32 ``[B]``; compress_plan / write_plan uint8 ``[rows, 16]`` (16-byte aligned);
    extra int32 ``[B, 4]`` (16-byte aligned): load_first_page, load_second_page, write_first_page,
    last_position. Returns kv_compressed_output.
    """
    op = _PREFILL
    tensors(op, dict(kv_score_buffer=kv_score_buffer, kv_score_input=kv_score_input,
                     kv_compressed_output=kv_compressed_output, ape=ape, indices=indices, compress_plan=compress_plan,
                     write_plan=write_plan, extra=extra), ("extra",))
    hd = _head_dim(op, kv_compressed_output)
    device = cuda_device(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan,
                          write_plan, extra)
    if device is None:
        check = TensorCheck(op)
        _check_common(check, hd, extra is not None, kv_score_buffer, kv_score_input, kv_compressed_output, ape,
                      indices, "num_q_tokens")
        check("compress_plan", compress_plan, ("compress_rows", LEGACY_PLAN_BYTES), (torch.uint8,))
        check("write_plan", write_plan, ("write_rows", LEGACY_PLAN_BYTES), (torch.uint8,))
        if extra is not None:
            check("extra", extra, ("batch_size", 4), (torch.int32,))
        tokens, batch = check.bound("num_q_tokens"), check.bound("batch_size")
        if tokens < batch:
            raise ArgumentError(f"dsv4jit.{op}: argument 'kv_score_input' must have at least one row per request "
                                f"(batch_size {batch}), got {tokens} rows")
        for arg, rows in (("compress_plan", check.bound("compress_rows")), ("write_plan", check.bound("write_rows"))):
            if rows > tokens:
                raise ArgumentError(f"dsv4jit.{op}: argument '{arg}' must have at most num_q_tokens ({tokens}) rows, "
                                    f"got {rows}")
        try:
            return ref.c4_prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan,
                                  write_plan, extra)
        except (ValueError, TypeError) as e:  # the reference names its argument: add the function's name
            raise reworded(op, e, locals()) from None
    if runtime.checks_enabled():
        checked.compat_prefill(op, kv_score_input, ape, compress_plan, write_plan, hd)
    _run(op, device, "prefill", _kernel(op, hd, kv_score_buffer, kv_score_input, kv_compressed_output),
         kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan, extra)
    return kv_compressed_output
