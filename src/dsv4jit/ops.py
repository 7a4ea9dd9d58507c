"""Public ops. CUDA tensors run the kernels; CPU tensors run the torch references (same results
within the precision contract), so the API works on a machine without a GPU.

Each public op checks its arguments, unpacks the plan and allocates its output, then calls one
custom op (library.py) that takes only tensors and scalars: what torch.compile records.
"""

from __future__ import annotations

import re
from typing import Optional, Union

import torch

from . import arguments, library, runtime
from .plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan
from .reference import compress as ref_compress
from .reference import store as ref_store

_DTYPE_NAMES = {torch.float32: ("fp32", "float32"), torch.bfloat16: ("bf16", "bfloat16"),
                torch.float16: ("fp16", "float16")}
_FLOAT_DTYPES = tuple(_DTYPE_NAMES)
_STATE_DTYPES = (torch.float32, torch.bfloat16)  # state pools, and every row the store step reads
_OP = "compress_forward"


def _cuda_device(*tensors: Optional[torch.Tensor]) -> Optional[torch.device]:
    """Kernels run when any tensor is on a GPU (their checks then name a tensor left on the CPU, so a
    device mix is an error, never a silent fallback to the reference); None when all are on the CPU."""
    for t in tensors:
        if t is not None and t.is_cuda:  # not t.device.type: that builds a device object per tensor
            return t.device
    return None


def _dtype_key(dtype: torch.dtype, arg: str, op: str = _OP, allowed: tuple = _FLOAT_DTYPES) -> str:
    """The kernel-parameter name of `dtype`; TypeError naming the argument if it is not `allowed`."""
    if dtype in allowed:
        return _DTYPE_NAMES[dtype][0]
    words = [_DTYPE_NAMES[d][1] for d in allowed]
    raise TypeError(f"dsv4jit.{op}: argument '{arg}': dtype must be {', '.join(words[:-1])} or {words[-1]}, "
                    f"got {dtype}")


def _dtype_name(t: torch.Tensor, arg: str, op: str = _OP, allowed: tuple = _FLOAT_DTYPES) -> str:
    return _dtype_key(t.dtype, arg, op, allowed)


def _state_pool(buffer: torch.Tensor, rows_per_page: int, width: int) -> torch.Tensor:
    """A flat contiguous ``[rows, width]`` state pool as the kernels' ``[pages, rows_per_page, width]``."""
    if buffer.dim() == 2 and buffer.shape[-1] == width and buffer.is_contiguous():
        return buffer.view(-1, rows_per_page, width)
    return buffer


def _num_q_tokens(plan) -> int:
    """What a prefill plan recorded (bounds out_loc); -1 for decode plans and plans built by hand."""
    return -1 if plan.is_decode or plan.num_q_tokens is None else plan.num_q_tokens


_COMPRESS_STATUS = {1: "a plan row names a state page outside kv_score_buffer",
                    2: "a plan row names a ragged row outside kv_score_input",
                    4: "a plan row names a state row (write_loc) outside kv_score_buffer"}
_STORE_STATUS = {1: "an out_loc entry of a stored row lies outside kvcache",
                 2: "a rope position (seq_len - compress_ratio) lies outside freq_cis",
                 4: "a plan row's ragged id lies beyond out_loc"}


def _describe(texts: dict[int, str]):
    return lambda code: "; ".join(text for bit, text in texts.items() if code & bit)


_DESCRIBE_COMPRESS, _DESCRIBE_STORE = _describe(_COMPRESS_STATUS), _describe(_STORE_STATUS)


_NAMED_OP = re.compile(r"dsv4jit\.[\w.]+")
_PLAN_FIELDS = ("plan_c", "plan_w", "plan_d")


def _public_error(op: str, error: Exception, given: dict, names: tuple, optional: tuple = (), explain=None):
    """Raise `error`, met by public op `op`, as what the user passed: an argument of the wrong type
    (arguments.explain), then what `explain(message)` finds (a head_dim the tensors do not have, a
    freq_cis of another form), else the error itself under the op's name. A torch reference names
    its own argument (`plan_w`, a field of the op's plan), a step of a fused op names that step: both
    become the op and its argument. Only failing calls get here, so the happy path pays nothing."""
    arguments.explain(op, given, names, optional)
    text = str(error)
    if explain is not None:
        explain(text)
    if not isinstance(error, (ValueError, TypeError)):
        raise error
    if text.startswith("dsv4jit."):
        text = _NAMED_OP.sub(f"dsv4jit.{op}", text, count=1)
    else:
        name = re.match(r"\w*", text).group()
        if name in _PLAN_FIELDS:
            text = f"dsv4jit.{op}: argument 'plan' ({name}){text[len(name):]}"
        elif name in given:
            text = f"dsv4jit.{op}: argument '{name}'{text[len(name):]}"
        else:
            text = f"dsv4jit.{op}: {text}"
    raise type(error)(text) from None


def _check_widths(op: str, message: str, head_dim: int, context: str, rows: dict) -> None:
    """After a failed call (`message`, unless it is about head_dim already): ValueError naming head_dim
    when a tensor's rows do not have the width it implies (`rows`: name -> (tensor, width))."""
    if "argument 'head_dim'" in message:
        return
    for name, (t, width) in rows.items():
        if t.dim() and t.shape[-1] != width:
            factor = "head_dim" if width == head_dim else f"{width // head_dim}·head_dim"
            raise ValueError(f"dsv4jit.{op}: argument 'head_dim' is {head_dim}, but the rows of '{name}' have "
                             f"{t.shape[-1]} values (shape {list(t.shape)}); {context} they have {factor} = {width}")


def _ring_widths(op: str, message: str, head_dim: int, compress_ratio: int, kv_score_buffer, kv_score_input,
                 ape) -> None:
    width = _row_width(compress_ratio, head_dim)
    _check_widths(op, message, head_dim, f"with compress_ratio {compress_ratio}",
                  {"kv_score_buffer": (kv_score_buffer, width), "kv_score_input": (kv_score_input, width),
                   "ape": (ape, head_dim)})


def _scalars(op: str, ints: dict, flags: dict) -> None:
    """TypeError naming an int or bool argument of another type (the callers test the types first)."""
    for name, value in ints.items():
        arguments.integer(op, name, value)
    for name, value in flags.items():
        arguments.flag(op, name, value)


def _check_ratio(op: str, plan, compress_ratio: int) -> None:
    if compress_ratio not in (4, 128):
        raise ValueError(f"dsv4jit.{op}: argument 'compress_ratio' must be 4 or 128, got {compress_ratio}")
    if plan.compress_ratio != compress_ratio:
        raise ValueError(f"dsv4jit.{op}: argument 'plan' was built for compress_ratio {plan.compress_ratio}, "
                         f"got compress_ratio {compress_ratio}")


def _ape_as(op: str, ape: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ape in the kernels' dtype (the consumer converts it the same way)."""
    if not ape.dtype.is_floating_point:
        raise TypeError(f"dsv4jit.{op}: argument 'ape': dtype must be a floating-point type, got {ape.dtype}")
    return ape if ape.dtype == dtype else ape.to(dtype)


def compress_forward(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                     plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *, head_dim: int,
                     compress_ratio: int, out: Optional[torch.Tensor] = None,
                     is_online: bool = False) -> torch.Tensor:
    """Softmax-pool every compress event of `plan` and store this step's tokens in the state ring.

    kv_score_buffer: state pool ``[num_pages, R, last_dim]`` (or flat ``[rows, last_dim]``), fp32 or
    bf16, updated in place; last_dim = 4·head_dim (c4) or 2·head_dim (c128).
    kv_score_input: ``[tokens, last_dim]`` (prefill: ragged; decode: one row per request).
    ape: ``[8, head_dim]`` (c4, rearranged) or ``[128, head_dim]``; converted to the input dtype.
    Returns ``[plan[1].shape[0], head_dim]`` (input dtype unless `out` is given): prefill row i pairs
    with plan_c row i (invalid rows untouched); decode rows off a compress boundary are zero.
    """
    plan = as_plan(_OP, plan)
    if type(head_dim) is not int or type(compress_ratio) is not int or type(is_online) is not bool:
        _scalars(_OP, {"head_dim": head_dim, "compress_ratio": compress_ratio}, {"is_online": is_online})
    if is_online:
        from .online import compress_forward_online  # online.py builds on this module's helpers

        return compress_forward_online(kv_score_buffer, kv_score_input, ape, plan, head_dim=head_dim,
                                       compress_ratio=compress_ratio, out=out)
    _check_ratio(_OP, plan, compress_ratio)
    try:
        ape = _ape_as(_OP, ape, kv_score_input.dtype)
        if out is None:  # on the input's device: a device mix is then reported by the checks, naming the argument
            out = torch.empty((plan[1].shape[0], head_dim), dtype=kv_score_input.dtype, device=kv_score_input.device)
        _compress(kv_score_buffer, kv_score_input, ape, plan[1], None if plan.is_decode else plan.plan_w, out,
                  head_dim, compress_ratio, plan.is_decode)
    except (ValueError, TypeError, AttributeError) as e:
        _public_error(_OP, e, locals(), ("kv_score_buffer", "kv_score_input", "ape"), ("out",),
                      lambda text: _ring_widths(_OP, text, head_dim, compress_ratio, kv_score_buffer, kv_score_input,
                                                ape))
    return out


@library.custom_op("compress", mutates_args=("kv_score_buffer", "out"))
def _compress(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor, plan_rows: torch.Tensor,
              plan_w: Optional[torch.Tensor], out: torch.Tensor, head_dim: int, compress_ratio: int,
              is_decode: bool) -> None:
    """compress_forward on unpacked plan tensors (plan_rows: plan_c or plan_d; plan_w: None in decode)."""
    kv_score_buffer = _state_pool(kv_score_buffer, compress_ratio, _row_width(compress_ratio, head_dim))
    device = _cuda_device(kv_score_buffer, kv_score_input, ape, out, plan_rows, plan_w)
    if device is None:
        _reference(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, head_dim, compress_ratio, out)
        return
    fn = runtime.function(f"compress_c{compress_ratio}", "decode" if is_decode else "prefill",
                          device, head_dim=head_dim,
                          state=_dtype_name(kv_score_buffer, "kv_score_buffer", allowed=_STATE_DTYPES),
                          input=_dtype_name(kv_score_input, "kv_score_input"), output=_dtype_name(out, "out"))
    status = runtime.status_word(device)
    if is_decode:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, out, status)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status)
    runtime.raise_status(status, _OP, _DESCRIBE_COMPRESS)


def _row_width(compress_ratio: int, head_dim: int) -> int:
    """Values per state/input row: kv_ov | kv | sc_ov | sc (c4) or kv | sc (c128)."""
    return (4 if compress_ratio == 4 else 2) * head_dim


def _reference(buffer, inputs, ape, plan_rows, plan_w, head_dim, ratio, out) -> None:
    if plan_w is None:
        ref_compress.compress_decode(buffer, inputs, ape, plan_rows, head_dim=head_dim, compress_ratio=ratio, out=out)
    else:
        ref_compress.compress_prefill(buffer, inputs, ape, plan_rows, plan_w, head_dim=head_dim, compress_ratio=ratio,
                                      out=out)


def _store_format(op: str, head_dim: int, use_fp4: bool, bf16_store: bool, head_dim_arg: str) -> str:
    """The cache format the flags select for `head_dim` (`head_dim_arg` says where head_dim came from)."""
    if head_dim == 512:
        if use_fp4:
            raise ValueError(f"dsv4jit.{op}: argument 'use_fp4' needs the indexer head_dim 128, got head_dim 512")
        return "v4_bf16" if bf16_store else "v4_fp8"
    if head_dim == 128:
        if bf16_store:
            raise ValueError(f"dsv4jit.{op}: argument 'bf16_store' needs head_dim 512, got head_dim 128")
        return "indexer_fp4" if use_fp4 else "indexer_fp8"
    raise ValueError(f"dsv4jit.{op}: argument {head_dim_arg} must be 512 or 128, got {head_dim}")


def _check_out_loc(op: str, is_decode: bool, num_q_tokens: int, out_loc: torch.Tensor, rows: int) -> None:
    if is_decode and out_loc.shape[0] != rows:
        raise ValueError(f"dsv4jit.{op}: argument 'out_loc' must have one entry per decode row ({rows}), "
                         f"got {out_loc.shape[0]}")
    if not is_decode and out_loc.shape[0] < num_q_tokens:
        raise ValueError(f"dsv4jit.{op}: argument 'out_loc' must have at least num_q_tokens "
                         f"({num_q_tokens}) entries, got {out_loc.shape[0]}")


def _freq_table(freq_cis: torch.Tensor) -> torch.Tensor:
    """complex64 [max_pos, 32] -> fp32 [max_pos, 64] of interleaved (cos, sin): a view, no copy.

    The custom ops take this real table: inductor cannot lower a mutating op with a complex operand.
    """
    if freq_cis.is_complex():
        return torch.view_as_real(freq_cis).reshape(freq_cis.shape[0], -1)
    return freq_cis


_ROPE_PAIRS = ref_store.ROPE_DIM // 2


def _check_freq(op: str, freq_cis: torch.Tensor) -> None:
    """After a failed call: freq_cis reported as the user passed it when it has neither accepted
    form (the checks downstream see the real view `_freq_table` made of it)."""
    if freq_cis.dim() == 2 and ((freq_cis.dtype == torch.complex64 and freq_cis.shape[1] == _ROPE_PAIRS)
                                or (freq_cis.dtype == torch.float32 and freq_cis.shape[1] == 2 * _ROPE_PAIRS)):
        return
    error = TypeError if freq_cis.dtype not in (torch.complex64, torch.float32) else ValueError
    raise error(f"dsv4jit.{op}: argument 'freq_cis' must be complex64 [max_pos, {_ROPE_PAIRS}] or float32 "
                f"[max_pos, {2 * _ROPE_PAIRS}] (interleaved cos, sin), got {list(freq_cis.shape)} {freq_cis.dtype}")


def _freq_cis(freq_table: torch.Tensor) -> torch.Tensor:
    """The complex view of a real (cos, sin) table, for the torch references."""
    return torch.view_as_complex(freq_table.reshape(freq_table.shape[0], -1, 2))


def compress_norm_rope_store(kv: torch.Tensor, plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *,
                             norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                             out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, use_fp4: bool = False,
                             bf16_store: bool = False, layout: str = "v4", fp8_2buff: bool = False,
                             kvcache_rope: Optional[torch.Tensor] = None) -> None:
    """RMSNorm, RoPE at position seq_len − R (+ Hadamard for the indexer), quantize, store at out_loc.

    kv: compressed rows ``[plan[1].shape[0], head_dim]`` (fp32 or bf16), as compress_forward returns.
    Prefill processes the valid plan rows and stores at ``out_loc[ragged_id]`` (out_loc covers every
    token of the step); decode processes the rows at a compress boundary and stores at ``out_loc[b]``.
    kvcache: ``[num_pages, page_bytes]`` uint8 view of the paged cache; formats by head_dim and flags:
    512 -> V4 fp8 latent (or bf16 rows with bf16_store), 128 -> indexer fp8 (or fp4 with use_fp4).
    """
    op = "compress_norm_rope_store"
    unavailable = [(name, value, only) for name, value, only, ok in (
        ("layout", layout, "v4", layout == "v4"), ("fp8_2buff", fp8_2buff, False, not fp8_2buff),
        ("kvcache_rope", kvcache_rope, None, kvcache_rope is None)) if not ok]
    for name, value, only in unavailable[:1]:  # the V4 layout only (contract §9.5)
        shown = type(value).__name__ if isinstance(value, torch.Tensor) else repr(value)
        raise NotImplementedError(f"dsv4jit.{op}: argument '{name}' can only be {only!r} (the V4 layout), got {shown}")
    plan = as_plan(op, plan)
    if type(page_size) is not int or type(use_fp4) is not bool or type(bf16_store) is not bool:
        _scalars(op, {"page_size": page_size}, {"use_fp4": use_fp4, "bf16_store": bf16_store})
    eps = arguments.nonnegative(op, "norm_eps", norm_eps)
    try:
        if kv.dim() != 2:
            raise ValueError(f"dsv4jit.{op}: argument 'kv' must be 2-D [rows, head_dim], got shape {list(kv.shape)}")
        fmt = _store_format(op, kv.shape[1], use_fp4, bf16_store, "'kv': head_dim (kv.shape[1])")
        if norm_weight.dtype != kv.dtype:
            norm_weight = norm_weight.to(kv.dtype)
        _norm_rope_store(kv, plan[1], norm_weight, _freq_table(freq_cis), out_loc, kvcache, fmt, page_size,
                         plan.compress_ratio, plan.is_decode, eps, _num_q_tokens(plan))
    except (ValueError, TypeError, AttributeError) as e:
        _public_error(op, e, locals(), ("kv", "norm_weight", "freq_cis", "out_loc", "kvcache"), (),
                      lambda text: _check_freq(op, freq_cis))


@library.custom_op("norm_rope_store", mutates_args=("kvcache",))
def _norm_rope_store(kv: torch.Tensor, plan_rows: torch.Tensor, norm_weight: torch.Tensor, freq: torch.Tensor,
                     out_loc: torch.Tensor, kvcache: torch.Tensor, store_format: str, page_size: int,
                     compress_ratio: int, is_decode: bool, norm_eps: float, num_q_tokens: int) -> None:
    """compress_norm_rope_store on unpacked plan rows (freq: the real (cos, sin) table; num_q_tokens -1:
    not recorded by the plan)."""
    op = "compress_norm_rope_store"
    device = _cuda_device(kv, plan_rows, norm_weight, freq, out_loc, kvcache)
    if device is None:
        _check_out_loc(op, is_decode, num_q_tokens, out_loc, kv.shape[0])  # the kernels check this themselves
        ref_store.compress_norm_rope_store(kv, plan_rows, is_decode=is_decode, compress_ratio=compress_ratio,
                                           norm_weight=norm_weight, norm_eps=norm_eps, freq_cis=_freq_cis(freq),
                                           out_loc=out_loc, kvcache=kvcache, page_size=page_size,
                                           use_fp4=store_format == "indexer_fp4", bf16_store=store_format == "v4_bf16")
        return
    fn = runtime.function("store", "run", device, dtype=_dtype_name(kv, "kv", op), format=store_format)
    status = runtime.status_word(device)
    fn(kv, plan_rows, norm_weight, freq, out_loc, kvcache, status, page_size, compress_ratio,
       is_decode, norm_eps, num_q_tokens)
    runtime.raise_status(status, op, _DESCRIBE_STORE)


def _check_store(rows: torch.Tensor, plan_rows: torch.Tensor, norm_weight: torch.Tensor, freq: torch.Tensor,
                 out_loc: torch.Tensor, kvcache: torch.Tensor, store_format: str, page_size: int, compress_ratio: int,
                 is_decode: bool, num_q_tokens: int) -> None:
    """The store step's checks on the CPU (rows: its input, values not read), for a fused op to run
    before its compress step writes the state."""
    _check_out_loc("compress_and_store", is_decode, num_q_tokens, out_loc, rows.shape[0])
    ref_store.checked_store(rows, plan_rows, is_decode=is_decode, compress_ratio=compress_ratio,
                            norm_weight=norm_weight, freq_cis=_freq_cis(freq), out_loc=out_loc, kvcache=kvcache,
                            page_size=page_size, use_fp4=store_format == "indexer_fp4",
                            bf16_store=store_format == "v4_bf16")


def compress_and_store(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                       plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *, head_dim: int,
                       compress_ratio: int, norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                       out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, use_fp4: bool = False,
                       bf16_store: bool = False, is_online: bool = False) -> None:
    """compress_forward followed by compress_norm_rope_store, fused: the pooled rows go straight from
    registers to the cache and never reach memory. Same arguments as the two ops (the compressed rows
    take the input dtype, fp32 or bf16); caches and states are byte-identical to the two-step path.

    Decode is one kernel launch; prefill is the fused pool-and-store kernel followed by the state-ring
    write pass (this step's ring writes may alias rows the pooling reads, so they must come after it).
    is_online=True fuses the online c128 compressor instead (online plans, head_dim 512, fp32 rows).
    """
    op = "compress_and_store"
    plan = as_plan(op, plan)
    if (type(head_dim) is not int or type(compress_ratio) is not int or type(page_size) is not int
            or type(use_fp4) is not bool or type(bf16_store) is not bool or type(is_online) is not bool):
        _scalars(op, {"head_dim": head_dim, "compress_ratio": compress_ratio, "page_size": page_size},
                 {"use_fp4": use_fp4, "bf16_store": bf16_store, "is_online": is_online})
    eps = arguments.nonnegative(op, "norm_eps", norm_eps)
    if is_online:
        from .online import compress_and_store_online  # online.py builds on this module's helpers

        return compress_and_store_online(kv_score_buffer, kv_score_input, ape, plan, head_dim=head_dim,
                                         compress_ratio=compress_ratio, norm_weight=norm_weight, norm_eps=eps,
                                         freq_cis=freq_cis, out_loc=out_loc, kvcache=kvcache, page_size=page_size,
                                         use_fp4=use_fp4, bf16_store=bf16_store)
    _check_ratio(op, plan, compress_ratio)
    fmt = _store_format(op, head_dim, use_fp4, bf16_store, "'head_dim'")
    if compress_ratio == 128 and head_dim != 512:
        raise ValueError(f"dsv4jit.{op}: argument 'head_dim' must be 512 with compress_ratio 128 (the V4 cache "
                         f"formats), got {head_dim}")
    try:
        ape = _ape_as(op, ape, kv_score_input.dtype)
        if norm_weight.dtype != kv_score_input.dtype:
            norm_weight = norm_weight.to(kv_score_input.dtype)
        _compress_and_store(kv_score_buffer, kv_score_input, ape, plan[1], None if plan.is_decode else plan.plan_w,
                            norm_weight, _freq_table(freq_cis), out_loc, kvcache, fmt, page_size, head_dim,
                            compress_ratio, plan.is_decode, eps, _num_q_tokens(plan))
    except (ValueError, TypeError, AttributeError) as e:
        _public_error(op, e, locals(), _FUSED_TENSORS, (), lambda text: (
            _ring_widths(op, text, head_dim, compress_ratio, kv_score_buffer, kv_score_input, ape),
            _check_freq(op, freq_cis)))


_FUSED_TENSORS = ("kv_score_buffer", "kv_score_input", "ape", "norm_weight", "freq_cis", "out_loc", "kvcache")


@library.custom_op("compress_and_store", mutates_args=("kv_score_buffer", "kvcache"))
def _compress_and_store(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                        plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], norm_weight: torch.Tensor,
                        freq: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, store_format: str,
                        page_size: int, head_dim: int, compress_ratio: int, is_decode: bool, norm_eps: float,
                        num_q_tokens: int) -> None:
    """compress_and_store on unpacked plan tensors (plan_w: None in decode; freq: the real table)."""
    op = "compress_and_store"
    kv_score_buffer = _state_pool(kv_score_buffer, compress_ratio, _row_width(compress_ratio, head_dim))
    device = _cuda_device(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache)
    if device is None:  # the reference of the two steps, the store's arguments checked before the first writes
        rows = torch.empty((plan_rows.shape[0], head_dim), dtype=kv_score_input.dtype)
        _check_store(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size, compress_ratio,
                     is_decode, num_q_tokens)
        _compress.impl(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, rows, head_dim, compress_ratio,
                       is_decode)
        _norm_rope_store.impl(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size,
                              compress_ratio, is_decode, norm_eps, num_q_tokens)
        return
    fn = runtime.function("fused", "decode" if is_decode else "prefill", device, ratio=compress_ratio,
                          format=store_format, state=_dtype_name(kv_score_buffer, "kv_score_buffer", op, _STATE_DTYPES),
                          input=_dtype_name(kv_score_input, "kv_score_input", op, _STATE_DTYPES))
    _call_fused(fn, op, _DESCRIBE_COMPRESS, device, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w,
                norm_weight, freq, out_loc, kvcache, page_size, norm_eps, num_q_tokens)


def _call_fused(fn, op: str, describe_compress, device: torch.device, kv_score_buffer: torch.Tensor,
                kv_score_input: torch.Tensor, ape: torch.Tensor, plan_rows: torch.Tensor,
                plan_w: Optional[torch.Tensor], norm_weight: torch.Tensor, freq: torch.Tensor, out_loc: torch.Tensor,
                kvcache: torch.Tensor, page_size: int, norm_eps: float, num_q_tokens: int) -> None:
    """Calls a fused entry point (decode: plan_w None) and raises what checked mode found: word 0 of the
    status holds the compress violations (`describe_compress`), word 1 the store ones."""
    status = runtime.status_word(device, words=2)
    if plan_w is None:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, norm_weight, freq, out_loc, kvcache, status, page_size,
           norm_eps)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache, status,
           page_size, norm_eps, num_q_tokens)
    if status is not None:
        runtime.raise_status(status[0] | (status[1] << 8), op,
                             lambda code: "; ".join(filter(None, (describe_compress(code & 0xFF),
                                                                  _DESCRIBE_STORE(code >> 8)))))
