"""Plans of one forward step: built once per compress ratio, shared by every layer of that ratio.

``CompressorPrefillPlan.generate`` picks the planner path from where the lengths live:
lengths on the GPU (CUDA-graph capture, MTP verify) -> one kernel, no host sync; lengths on the
CPU -> host-side table, one kernel; everything on the CPU -> the host planner, CPU plans. All
paths produce the same bytes (rows in batch-major, position-ascending order).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from . import arguments, plan_layout, runtime
from .errors import ArgumentError, ArgumentTypeError
from .family import Family, KernelChoice

_OP_PREFILL = "CompressorPrefillPlan.generate"
_OP_DECODE = "CompressorDecodePlan.generate"
_TABLES = 3  # req_pool_indices, req_to_token, full_to_state: what describe_status takes
#: Tables each planner family reads (online plans read req_pool_indices only).
_READS = {"prefill": 3, "decode": 3, "prefill_online": 1, "decode_online": 1}


def kernel(on_gpu: bool) -> KernelChoice:
    """The planner a call runs: the GPU planner, or the host-compiled one when every input is on the CPU."""
    return ("plan" if on_gpu else "plan_host"), {}


FAMILY = Family("plan", lambda cfg: [kernel(on_gpu=not cfg.host)])


def _placement(tables, lengths) -> tuple[torch.device, bool]:
    """(device, on a GPU) of the plans: with the first lookup table on a GPU, else with the lengths
    if one of them is, else the CPU. Any CUDA tensor sends the call to the kernels, whose checks
    then name a tensor left on the CPU. `is_cuda` over `device.type`: this runs on every step's
    host path."""
    for t in tables:
        if t is not None and t.is_cuda:
            return t.device, True
    for t in lengths:
        if t.is_cuda:
            return t.device, True
    return tables[0].device, False


def _distinct_slots(op: str, req_pool_indices: torch.Tensor) -> None:
    """Two requests of one step on one slot would write one state: ValueError naming the argument
    (made where it costs no sync: every input on the CPU, or checked mode)."""
    if req_pool_indices.numel() != torch.unique(req_pool_indices).numel():
        raise ArgumentError(f"dsv4jit.{op}: argument 'req_pool_indices': two requests name one slot (their steps "
                            f"would write one state), got {req_pool_indices.tolist()[:64]}")


def _plan_status(device: torch.device) -> torch.Tensor | None:
    """Checked mode: the planner's status words (bits, padding, lowest violation key as u64)."""
    return torch.tensor([0, 0, -1, -1], dtype=torch.int32, device=device) if runtime.checks_enabled() else None


def _raise_status(status, op: str, device: torch.device, tables, seq_lens, extend_lens=None) -> None:
    """Checked mode on the GPU: sync, and raise ValueError naming the first offending argument,
    index and value (the planner reads them back from the inputs) if the kernel reported one."""
    if status is None:
        return
    words = status.cpu()
    if int(words[0]):
        padded = (*tables, *(None,) * (_TABLES - len(tables)))
        text = runtime.function(kernel(on_gpu=True)[0], "describe_status", device)(words, *padded, seq_lens, extend_lens)
        raise ArgumentError(f"dsv4jit.{op} (checked mode): {text}")


def _prefill(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, swa_page_size,
             ring_size, num_q_tokens, use_cuda_graph, use_req_ring, legacy):
    args = (compress_ratio, swa_page_size, ring_size, use_req_ring, legacy)
    op = _OP_PREFILL + "_legacy" if legacy else _OP_PREFILL
    return _plan_prefill("prefill", op, (req_pool_indices, req_to_token, full_to_state), args, seq_lens,
                         extend_lens, num_q_tokens, use_cuda_graph, plan_layout.WRITE_PLAN_BYTES)


def _plan_prefill(entry, op, tables, args, seq_lens, extend_lens, num_q_tokens, use_cuda_graph, write_row_bytes):
    """One planner family's prefill entry points (`entry`, `entry`_counts/_device/_host_lengths): the path
    by where lengths and lookup tables (`tables`, led by req_pool_indices) live."""
    num_q_tokens = operator.index(num_q_tokens)  # a float is a TypeError, which the caller explains
    device, on_gpu = _placement(tables, (seq_lens, extend_lens))
    if not on_gpu or runtime.checks_enabled():
        _distinct_slots(op, tables[0])
    name = kernel(on_gpu)[0]
    if seq_lens.is_cuda or use_cuda_graph:  # bucket-sized plans, invalid past the counts
        rows_c = rows_w = num_q_tokens
    else:  # lengths on the host: count first (O(batch)) so the plans get their exact shapes
        counts = runtime.function(name, entry + "_counts", device)(seq_lens, extend_lens, num_q_tokens, *args)
        rows_c, rows_w = counts >> 32, counts & 0xFFFFFFFF
    plan_c = torch.empty((rows_c, 16), dtype=torch.uint8, device=device)
    plan_w = torch.empty((rows_w, write_row_bytes), dtype=torch.uint8, device=device)
    if not on_gpu:  # every input on the host: the host planner checks them in default mode too
        runtime.function(name, entry, device)(*tables, seq_lens, extend_lens, plan_c, plan_w, num_q_tokens, *args,
                                               use_cuda_graph, runtime.checks_enabled())
        return plan_c, plan_w
    status = _plan_status(device)
    if seq_lens.is_cuda:
        runtime.function(name, entry + "_device", device)(*tables, seq_lens, extend_lens, plan_c, plan_w, status,
                                                           *args)
    else:
        runtime.function(name, entry + "_host_lengths", device)(*tables, seq_lens, extend_lens, plan_c, plan_w,
                                                                 status, num_q_tokens, *args, use_cuda_graph)
    _raise_status(status, op, device, tables[:_READS[entry]], seq_lens, extend_lens)
    return plan_c, plan_w


def _decode(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size, ring_size,
            use_req_ring, legacy):
    args = (compress_ratio, swa_page_size, ring_size, use_req_ring, legacy)
    op = _OP_DECODE + "_legacy" if legacy else _OP_DECODE
    return _plan_decode("decode", op, (req_pool_indices, req_to_token, full_to_state), args, seq_lens)


def _plan_decode(entry, op, tables, args, seq_lens):
    """The kernel call allocates plan_d itself (torch's caching allocator, through tvm-ffi) where
    torch allows it (runtime.kernels_allocate), else fills one allocated here."""
    device, on_gpu = _placement(tables, (seq_lens,))
    if not on_gpu or runtime.checks_enabled():
        _distinct_slots(op, tables[0])
    plan_d = None
    if not runtime.kernels_allocate():
        plan_d = torch.empty((seq_lens.shape[0] if seq_lens.dim() == 1 else 0, 16), dtype=torch.uint8, device=device)
    name = kernel(on_gpu)[0]
    if not on_gpu:
        made = runtime.function(name, entry, device)(*tables, seq_lens, plan_d, *args, runtime.checks_enabled())
    else:
        status = _plan_status(device)
        made = runtime.function(name, entry, device)(*tables, seq_lens, plan_d, status, *args)
        _raise_status(status, op, device, tables[:_READS[entry]], seq_lens)
    return plan_d if made is None else made


def _reads_state(seq_lens: torch.Tensor, extend_lens: torch.Tensor) -> bool:
    """Whether a ring prefill's pool pass may read state rows: False only where the lengths are on
    the host (a look costs no sync) and no request has a prefix (seq_lens equal extend_lens), so
    that every window slot before a request's first token is masked (contract §4.2, contract §4.4)."""
    return seq_lens.is_cuda or extend_lens.is_cuda or not bool((seq_lens == extend_lens).all())


_PREFILL_TENSORS = ("req_pool_indices", "seq_lens", "extend_lens")
_DECODE_TENSORS = ("req_pool_indices", "seq_lens")
_PAGED_INTS = ("compress_ratio", "swa_page_size", "ring_size")


def _check_copy(self, other, fields) -> None:
    op = f"dsv4jit.{type(self).__name__}.copy_: argument 'other'"
    if type(other) is not type(self):
        raise ArgumentTypeError(f"{op} must be a {type(self).__name__}, got {type(other).__name__}")
    if other.compress_ratio != self.compress_ratio:
        raise ArgumentError(f"{op}: compress_ratio must be {self.compress_ratio}, got {other.compress_ratio}")
    for name in fields:
        mine, theirs = getattr(self, name), getattr(other, name)
        if mine.shape != theirs.shape:
            raise ArgumentError(f"{op}: {name} must have shape {list(mine.shape)}, got {list(theirs.shape)}")


@dataclass
class CompressorDecodePlan:
    """Decode plan: one 16-byte DecodePlan row per request (``plan[1]``, ``plan_rows``, is ``plan_d``)."""

    compress_ratio: int
    plan_d: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return True

    @property
    def plan_rows(self) -> torch.Tensor:
        """The rows the compress and store passes read: plan_d."""
        return self.plan_d

    @property
    def write_rows(self) -> None:
        """A decode writes each request's token from its plan row: no write rows."""
        return None

    @property
    def kernel_num_q_tokens(self) -> int:
        """Decode rows bound out_loc themselves (one entry per row): -1, as the kernels take it."""
        return -1

    @property
    def reads_state(self) -> bool:
        """A decode window reads the state ring."""
        return True

    def __getitem__(self, index):
        return (self.compress_ratio, self.plan_d)[index]

    def __iter__(self):
        return iter((self.compress_ratio, self.plan_d))

    def __len__(self) -> int:
        return 2

    def copy_(self, other: "CompressorDecodePlan") -> "CompressorDecodePlan":
        """Refresh CUDA-graph buffers in place from a freshly generated plan."""
        _check_copy(self, other, ("plan_d",))
        self.plan_d.copy_(other.plan_d)
        return self

    def rows(self) -> plan_layout.DecodeRows:
        """Decoded fields (for debugging and tests)."""
        return plan_layout.decode_decode_plan(self.plan_d)

    @classmethod
    def generate(cls, compress_ratio: int, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                 full_to_state: torch.Tensor, seq_lens: torch.Tensor, swa_page_size: int, ring_size: int,
                 use_req_ring: bool = False) -> "CompressorDecodePlan":
        with arguments.explained(_OP_DECODE, locals(), (*_DECODE_TENSORS, "req_to_token", "full_to_state"),
                                 int_names=_PAGED_INTS, flag_names=("use_req_ring",)):
            plan_d = _decode(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size,
                             ring_size, use_req_ring, False)
        return cls(compress_ratio, plan_d)

    @classmethod
    def generate_legacy(cls, compress_ratio: int, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor) -> "CompressorDecodePlan":
        """Non-paged rings: c4 pages 2·rid and 2·rid+1, c128 page rid."""
        with arguments.explained(_OP_DECODE + "_legacy", locals(), _DECODE_TENSORS, int_names=("compress_ratio",)):
            plan_d = _decode(compress_ratio, req_pool_indices, None, None, seq_lens, 0, 0, False, True)
        return cls(compress_ratio, plan_d)

    @classmethod
    def generate_online(cls, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                        state_slot_offset: int = 0) -> "CompressorDecodePlan":
        """Online c128 (contract §3.8): row b = {seq_len, rid + offset, rid + offset, -1} (state loaded and stored in place)."""
        with arguments.explained(_OP_DECODE + "_online", locals(), _DECODE_TENSORS, ("req_to_token",),
                                 int_names=("state_slot_offset",)):
            plan_d = _plan_decode("decode_online", _OP_DECODE + "_online", (req_pool_indices, req_to_token),
                                  (state_slot_offset,), seq_lens)
        return cls(128, plan_d)


@dataclass
class CompressorPrefillPlan:
    """Prefill plan: CompressPlan rows (``plan[1]``, ``plan_rows``) and WritePlan rows (``plan[2]``), or an online
    plan's OnlinePlan segment rows in both."""

    compress_ratio: int
    plan_c: torch.Tensor
    plan_w: torch.Tensor
    # the upstream plan tuple's fourth entry; dsv4jit's planners need no staging buffer and set None,
    # and a given one is ignored
    pin_buffer: Optional[torch.Tensor] = None
    num_q_tokens: Optional[int] = None  # recorded by generate*; bounds out_loc in the store step
    is_online: bool = False  # set by generate_online: the rows are segment rows (OnlinePlan)
    # False where generate saw on the host that no request has a prefix: the pool pass then reads
    # no state row, and a ring prefill runs its two passes in one grid (csrc/compress/ring.cuh)
    reads_state: bool = True

    @property
    def is_decode(self) -> bool:
        return False

    @property
    def plan_rows(self) -> torch.Tensor:
        """The rows the compress and store passes read: plan_c."""
        return self.plan_c

    @property
    def write_rows(self) -> torch.Tensor:
        """The state-ring write pass's rows: plan_w."""
        return self.plan_w

    @property
    def kernel_num_q_tokens(self) -> int:
        """num_q_tokens as the kernels take it (the least number of out_loc entries): -1 where no
        generate* recorded it."""
        return -1 if self.num_q_tokens is None else self.num_q_tokens

    def __getitem__(self, index):
        return (self.compress_ratio, self.plan_c, self.plan_w, self.pin_buffer)[index]

    def __iter__(self):
        return iter((self.compress_ratio, self.plan_c, self.plan_w, self.pin_buffer))

    def __len__(self) -> int:
        return 4

    def copy_(self, other: "CompressorPrefillPlan") -> "CompressorPrefillPlan":
        """Refresh CUDA-graph buffers in place from a freshly generated plan."""
        _check_copy(self, other, ("plan_c", "plan_w"))
        self.plan_c.copy_(other.plan_c)
        self.plan_w.copy_(other.plan_w)
        self.num_q_tokens = other.num_q_tokens
        self.reads_state = other.reads_state
        return self

    def rows(self) -> (tuple[plan_layout.CompressRows, plan_layout.WriteRows]
                       | tuple[plan_layout.OnlineRows, plan_layout.OnlineRows]):
        """Decoded fields (for debugging and tests); online plans hold segment rows in both."""
        if self.is_online:
            return plan_layout.decode_online_plan(self.plan_c), plan_layout.decode_online_plan(self.plan_w)
        return plan_layout.decode_compress_plan(self.plan_c), plan_layout.decode_write_plan(self.plan_w)

    @classmethod
    def generate(cls, compress_ratio: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 extend_lens: torch.Tensor, req_to_token: torch.Tensor, full_to_state: torch.Tensor,
                 swa_page_size: int, ring_size: int, num_q_tokens: int, use_cuda_graph: bool = False,
                 use_req_ring: bool = False) -> "CompressorPrefillPlan":
        with arguments.explained(_OP_PREFILL, locals(), (*_PREFILL_TENSORS, "req_to_token", "full_to_state"),
                                 int_names=(*_PAGED_INTS, "num_q_tokens"),
                                 flag_names=("use_cuda_graph", "use_req_ring")):
            plan_c, plan_w = _prefill(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token,
                                      full_to_state, swa_page_size, ring_size, num_q_tokens, use_cuda_graph,
                                      use_req_ring, False)
        return cls(compress_ratio, plan_c, plan_w, None, int(num_q_tokens),
                   reads_state=_reads_state(seq_lens, extend_lens))

    @classmethod
    def generate_legacy(cls, compress_ratio: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        extend_lens: torch.Tensor, num_q_tokens: int, device=None,
                        use_cuda_graph: bool = False) -> "CompressorPrefillPlan":
        """Non-paged rings; plans go to `device` (default: where req_pool_indices lives)."""
        with arguments.explained(_OP_PREFILL + "_legacy", locals(), _PREFILL_TENSORS,
                                 int_names=("compress_ratio", "num_q_tokens"), flag_names=("use_cuda_graph",)):
            if device is not None and torch.device(device) != req_pool_indices.device:
                req_pool_indices = req_pool_indices.to(device)
            plan_c, plan_w = _prefill(compress_ratio, req_pool_indices, seq_lens, extend_lens, None, None, 0, 0,
                                      num_q_tokens, use_cuda_graph, False, True)
        return cls(compress_ratio, plan_c, plan_w, None, int(num_q_tokens),
                   reads_state=_reads_state(seq_lens, extend_lens))

    @classmethod
    def generate_online(cls, seq_lens: torch.Tensor, extend_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                        req_to_token: torch.Tensor, num_q_tokens: int, use_cuda_graph: bool = False,
                        state_slot_offset: int = 0) -> "CompressorPrefillPlan":
        """Online c128 (contract §3.8): each request's extend range split at 128-chunk boundaries into segments;
        plan_c holds the segments that close a chunk, plan_w the trailing partial ones (both 16-byte
        OnlinePlan rows: segment_len, store_slot = rid + offset, load_slot = rid)."""
        with arguments.explained(_OP_PREFILL + "_online", locals(), _PREFILL_TENSORS, ("req_to_token",),
                                 int_names=("num_q_tokens", "state_slot_offset"), flag_names=("use_cuda_graph",)):
            plan_c, plan_w = _plan_prefill("prefill_online", _OP_PREFILL + "_online", (req_pool_indices, req_to_token),
                                           (state_slot_offset,), seq_lens, extend_lens, num_q_tokens,
                                           use_cuda_graph, plan_layout.ONLINE_PLAN_BYTES)
        return cls(128, plan_c, plan_w, None, int(num_q_tokens), is_online=True)


def check_batch(op: str, plan: CompressorPrefillPlan | CompressorDecodePlan,
                inputs: Mapping[str, torch.Tensor] = {}, locations: Mapping[str, torch.Tensor] = {}) -> None:
    """ValueError naming `plan` and the argument whose size shows that the two are of different
    batches or steps: a decode plan has one row per request, which each of `inputs` must have too,
    and each of `locations` one entry; a prefill plan recorded its step's tokens (num_q_tokens),
    which each of `inputs` must have as rows and each of `locations` at least as entries. Where the
    sizes agree (a same-size plan of another step, or a plan built by hand, which records no
    tokens) they cannot tell."""
    if plan.is_decode:
        want = plan.plan_d.shape[0]
        made = f"a decode plan of {want} requests"
    elif plan.num_q_tokens is not None:
        want = plan.num_q_tokens
        made = f"a prefill plan of {want} tokens (num_q_tokens)"
    else:
        return
    sizes = [(name, t.shape[0], "rows") for name, t in inputs.items() if t.dim() and t.shape[0] != want]
    sizes += [(name, t.numel(), "entries") for name, t in locations.items()
              if (t.numel() != want if plan.is_decode else t.numel() < want)]
    for name, size, unit in sizes[:1]:
        raise ArgumentError(f"dsv4jit.{op}: argument 'plan' and argument '{name}' are of different batches or steps: "
                            f"the plan is {made}, '{name}' has {size} {unit}")


def as_plan(op: str, plan) -> CompressorPrefillPlan | CompressorDecodePlan:
    """The plan an op was given, or the one its tuple form describes: (compress_ratio, plan_c,
    plan_w, pin_buffer) for prefill, (compress_ratio, plan_d) for decode, as the reference API's."""
    if isinstance(plan, (CompressorPrefillPlan, CompressorDecodePlan)):
        return plan
    if isinstance(plan, tuple) and len(plan) in (2, 4):
        return CompressorDecodePlan(*plan) if len(plan) == 2 else CompressorPrefillPlan(*plan)
    raise ArgumentTypeError(f"dsv4jit.{op}: argument 'plan' must be a CompressorPrefillPlan or "
                            f"CompressorDecodePlan (or the tuple (compress_ratio, plan_c, plan_w, pin_buffer) or "
                            f"(compress_ratio, plan_d)), "
                            f"got {type(plan).__name__}")
