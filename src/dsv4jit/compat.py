"""The older c4 compress entry points (contract §7), kept for callers of that interface.

``flash_c4_decode`` / ``flash_c4_prefill`` take the arguments of the older kernel's run_decode /
run_prefill, in the same order: requests are addressed by ``indices`` (int32, one per request) and,
in decode, ``seq_lens`` (int32); the optional ``extra`` tensor selects the 4-aligned paged mode
(``kv_score_buffer [num_pages, 4, 4·hd]``) instead of one 8-row ring per request
(``[num_indices, 8, 4·hd]``). Prefill plans are ``uint8 [rows, 16]`` rows of the older PrefillPlan
``{ragged_id, batch_id, position, window_len}`` (``dsv4jit.reference.compat.encode_legacy_plan``)
and the output is indexed by ragged id. See ``dsv4jit.reference.compat`` for the exact semantics.

CUDA tensors run the kernels (csrc/compat_c4.cuh, built on the main c4 kernel's device code); all-CPU
tensors run the torch reference; a CPU/CUDA mix raises TypeError naming the argument on the CPU.
head_dim (128 or 512) is ``kv_compressed_output.shape[1]``. Differences from the older kernel: the
state may be bf16 while the input is fp32 (inputs and outputs fp32, bf16 or fp16), decode rows off a
compress boundary are zero-filled, the masked first-window slots are never read, and every entry a
plan or index names is range-checked (checked mode reports a skipped row as ValueError).
"""

from __future__ import annotations

import torch

from . import runtime
from .ops import _FLOAT_DTYPES, _STATE_DTYPES, _cuda_device, _describe, _dtype_name, _public_error
from .plan_layout import LEGACY_PLAN_BYTES
from .reference import compat as ref

__all__ = ["flash_c4_decode", "flash_c4_prefill"]

_DECODE, _PREFILL = "flash_c4_decode", "flash_c4_prefill"
_HEAD_DIMS = (128, 512)
_STATUS = {1: "an indices / extra entry names a page outside kv_score_buffer",
           2: "a plan row names a ragged row outside kv_score_input",
           4: "a plan row's batch_id is not below the batch size",
           8: "a malformed row (compress position % 4 != 3 or window_len >= 8; decode seq_len < 1)"}


class _Args:
    """Argument checks of the CPU path, with the kernels' rules and messages (symbolic sizes bind
    on first use, like csrc/common/tensor_check.h)."""

    def __init__(self, op: str):
        self.op = op
        self.sizes: dict[str, tuple[int, str]] = {}

    def fail(self, exc, arg: str, what: str):
        raise exc(f"dsv4jit.{self.op}: argument '{arg}': {what}")

    def __call__(self, arg: str, t: torch.Tensor, shape: tuple, dtypes: tuple, align: int = 16) -> None:
        if t.dim() != len(shape):
            self.fail(ValueError, arg, f"must have {len(shape)} dimensions, got {t.dim()} (shape {list(t.shape)})")
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if isinstance(want, str):
                bound, by = self.sizes.setdefault(want, (got, arg))
                if bound != got:
                    self.fail(ValueError, arg, f"dim {i} ('{want}') must be {bound} (as in '{by}'), got {got}")
            elif want != got:
                self.fail(ValueError, arg, f"dim {i} must be {want}, got {got} (shape {list(t.shape)})")
        if t.dtype not in dtypes:
            self.fail(TypeError, arg, f"dtype must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if not t.is_contiguous():
            self.fail(ValueError, arg, "must be contiguous (row-major)")
        if t.data_ptr() % align:
            self.fail(ValueError, arg, f"data pointer must be {align}-byte aligned")

    def bound(self, name: str) -> int:
        return self.sizes[name][0]


def _tensors(op: str, **named) -> None:
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) and not (name == "extra" and t is None):
            raise TypeError(f"dsv4jit.{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")


def _head_dim(op: str, out: torch.Tensor) -> int:
    if out.dim() != 2 or out.shape[1] not in _HEAD_DIMS:
        raise ValueError(f"dsv4jit.{op}: argument 'kv_compressed_output' must be [rows, head_dim] with head_dim "
                         f"128 or 512, got shape {list(out.shape)}")
    return out.shape[1]


def _check_common(check: _Args, hd: int, paged: bool, buffer, inputs, out, ape, indices, rows: str) -> None:
    check("kv_score_buffer", buffer, ("num_pages" if paged else "num_indices", 4 if paged else 8, 4 * hd),
          _STATE_DTYPES)
    check("kv_score_input", inputs, (rows, 4 * hd), _FLOAT_DTYPES)
    check("kv_compressed_output", out, (rows, hd), _FLOAT_DTYPES)
    check("ape", ape, (8, hd), (inputs.dtype,))
    check("indices", indices, ("batch_size",), (torch.int32,), align=4)


def _kernel(op: str, device: torch.device, export: str, hd: int, buffer, inputs, out):
    return runtime.function("compat_c4", export, device, head_dim=hd,
                            state=_dtype_name(buffer, "kv_score_buffer", op, _STATE_DTYPES),
                            input=_dtype_name(inputs, "kv_score_input", op),
                            output=_dtype_name(out, "kv_compressed_output", op))


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
    _tensors(op, kv_score_buffer=kv_score_buffer, kv_score_input=kv_score_input,
             kv_compressed_output=kv_compressed_output, ape=ape, indices=indices, seq_lens=seq_lens, extra=extra)
    hd = _head_dim(op, kv_compressed_output)
    device = _cuda_device(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra)
    if device is None:
        check = _Args(op)
        _check_common(check, hd, extra is not None, kv_score_buffer, kv_score_input, kv_compressed_output, ape,
                      indices, "batch_size")
        check("seq_lens", seq_lens, ("batch_size",), (torch.int32,), align=4)
        if extra is not None:
            check("extra", extra, ("batch_size", 1), (torch.int32,), align=4)
        try:
            return ref.c4_decode(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra)
        except (ValueError, TypeError) as e:  # the reference names its argument: add the function's name
            _public_error(op, e, locals(), ())
    fn = _kernel(op, device, "decode", hd, kv_score_buffer, kv_score_input, kv_compressed_output)
    status = runtime.status_word(device)
    fn(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, extra, status)
    runtime.raise_status(status, op, _describe(_STATUS))
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
    _tensors(op, kv_score_buffer=kv_score_buffer, kv_score_input=kv_score_input,
             kv_compressed_output=kv_compressed_output, ape=ape, indices=indices, compress_plan=compress_plan,
             write_plan=write_plan, extra=extra)
    hd = _head_dim(op, kv_compressed_output)
    device = _cuda_device(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan,
                          write_plan, extra)
    if device is None:
        check = _Args(op)
        _check_common(check, hd, extra is not None, kv_score_buffer, kv_score_input, kv_compressed_output, ape,
                      indices, "num_q_tokens")
        check("compress_plan", compress_plan, ("compress_rows", LEGACY_PLAN_BYTES), (torch.uint8,))
        check("write_plan", write_plan, ("write_rows", LEGACY_PLAN_BYTES), (torch.uint8,))
        if extra is not None:
            check("extra", extra, ("batch_size", 4), (torch.int32,))
        tokens, batch = check.bound("num_q_tokens"), check.bound("batch_size")
        if tokens < batch:
            raise ValueError(f"dsv4jit.{op}: argument 'kv_score_input' must have at least one row per request "
                             f"(batch_size {batch}), got {tokens} rows")
        for arg, rows in (("compress_plan", check.bound("compress_rows")), ("write_plan", check.bound("write_rows"))):
            if rows > tokens:
                raise ValueError(f"dsv4jit.{op}: argument '{arg}' must have at most num_q_tokens ({tokens}) rows, "
                                 f"got {rows}")
        try:
            return ref.c4_prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan,
                                  write_plan, extra)
        except (ValueError, TypeError) as e:  # the reference names its argument: add the function's name
            _public_error(op, e, locals(), ())
    fn = _kernel(op, device, "prefill", hd, kv_score_buffer, kv_score_input, kv_compressed_output)
    status = runtime.status_word(device)
    fn(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan, extra, status)
    runtime.raise_status(status, op, _describe(_STATUS))
    return kv_compressed_output
