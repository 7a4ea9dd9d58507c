"""Checked mode's value checks on the GPU paths, made before the launch: what the CPU paths'
references reject as well (a NaN or an infinity in a value a call uses, which would reach the state
and the cache without a word), named by argument in the op's words. Each check reads the values
back (a sync), so the ops call these only in checked mode; the default path does none of this work.

What a call uses is what its references check (reference/compress.py, `check_finite`): the input
values its plan reads or stores, ape, and the store step's rows, norm weight and rope table rows.
What no plan row uses (CUDA-graph padding rows) and the state pools are never checked: a cleared
state row's score is -inf by design, as a masked window slot's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import arguments
from ..geometry import INDEXER_HEAD_DIM, V4_HEAD_DIM
from ..plan_layout import ONLINE_PLAN_BYTES
from ..reference import compat as ref_compat
from ..reference import compress as ref_compress
from ..reference import online as ref_online
from ..reference import store as ref_store


@contextmanager
def _named(op: str, names):
    """A ValueError of the checks inside, in `op`'s words (naming the argument among `names`)."""
    try:
        yield
    except ValueError as e:
        raise arguments.reworded(op, e, names) from None


def inputs(op: str, **named: torch.Tensor) -> None:
    """ValueError naming the first of `named`, tensors a call uses whole, that is not finite."""
    with _named(op, named):
        for name, t in named.items():
            arguments.finite(name, t)


def compressor(op: str, kv_score_input: torch.Tensor, ape: torch.Tensor, plan_rows: torch.Tensor,
               plan_w: torch.Tensor | None, head_dim: int, compress_ratio: int) -> None:
    """A compressor's input values its plan uses (decode: all; an online plan's 16-byte write rows
    tell it from a ring one), and ape."""
    if plan_w is None:
        used = None
    elif plan_w.shape[-1] == ONLINE_PLAN_BYTES:
        used = ref_online.prefill_use(plan_rows, plan_w, kv_score_input.shape)
    else:
        used = ref_compress.prefill_use(plan_rows, plan_w, kv_score_input.shape, head_dim, compress_ratio)
    with _named(op, ("kv_score_input", "ape")):
        ref_compress.check_finite(kv_score_input, ape, used)


def compat_prefill(op: str, kv_score_input: torch.Tensor, ape: torch.Tensor, compress_plan: torch.Tensor,
                   write_plan: torch.Tensor, head_dim: int) -> None:
    """`compressor` for the older c4 interface's prefill plans."""
    used = ref_compat.prefill_use(compress_plan, write_plan, kv_score_input.shape, head_dim)
    with _named(op, ("kv_score_input", "ape")):
        ref_compress.check_finite(kv_score_input, ape, used)


def store(op: str, kv: torch.Tensor | None, plan_rows: torch.Tensor, norm_weight: torch.Tensor, freq: torch.Tensor,
          out_loc: torch.Tensor, compress_ratio: int, is_decode: bool) -> None:
    """The store step's rows (reference/store.py, `stored_rows`): no two stored rows name one cache
    location, and their values are finite: kv's stored rows (None: a fused op's own rows), the norm
    weight, the rope table at the stored positions."""
    with _named(op, ("out_loc", "kv", "norm_weight", "freq_cis")):
        ref_store.stored_rows(kv, plan_rows, out_loc, norm_weight, freq, is_decode=is_decode,
                              compress_ratio=compress_ratio)


def fused(op: str, kv_score_input: torch.Tensor, ape: torch.Tensor, plan_rows: torch.Tensor,
          plan_w: torch.Tensor | None, norm_weight: torch.Tensor, freq: torch.Tensor, out_loc: torch.Tensor,
          head_dim: int, compress_ratio: int) -> None:
    """A compressor's and its store step's values (`compressor`, `store`)."""
    compressor(op, kv_score_input, ape, plan_rows, plan_w, head_dim, compress_ratio)
    store(op, None, plan_rows, norm_weight, freq, out_loc, compress_ratio, plan_w is None)


def layer(op: str, plan_rows: torch.Tensor, plan_w: torch.Tensor | None, freq: torch.Tensor, ratio: int,
          core: tuple, indexer: tuple) -> None:
    """`fused` of a c4 layer's two compressors, `core` and `indexer` each (kv_score_input, ape,
    norm_weight, out_loc); their errors name the step (``op[core]``, ``op[indexer]``), which the
    layer op turns into its argument names."""
    for step, head_dim, (kv_score_input, ape, norm_weight, out_loc) in (
            (f"{op}[core]", V4_HEAD_DIM, core), (f"{op}[indexer]", INDEXER_HEAD_DIM, indexer)):
        fused(step, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, head_dim, ratio)
