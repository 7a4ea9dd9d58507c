"""The paged KV cache layouts of the DeepSeek-V4 family and their names (contract §10.1).

A layout fixes, per token, its data bytes (value codes), its scale bytes (one scale per tile of
values) and their arrangement in a page:

* **block-split** (``v4``, ``v41``, ``v41_fp4``, ``uniform_fp8``): the page holds the data rows of all
  its ``page_size`` slots, then their scale rows, padded to a multiple of ``page_align`` bytes;
* **interleaved** (``v41_new``, ``v41_fp4_new``): slot ``i`` owns bytes ``[i·bpt, (i+1)·bpt)`` of the
  page (``bpt`` = bytes per token), its data then its scales; no padding.

The ``_new`` layouts store exactly the bytes of their ``encoding`` (``v41``, ``v41_fp4``); only the
arrangement differs. Pure Python: the bottom layer, beside ``geometry.py``.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from .errors import ArgumentError


class _Facts(NamedTuple):
    data_bytes: int    # value codes per token
    scale_bytes: int   # scale bytes per token (v4: 7 exponents + 1 padding byte never written)
    tile_size: int     # values sharing one scale
    page_align: int    # the page stride is a multiple of it
    encoding: str      # the block-split layout whose token bytes these are
    interleaved: bool


#: The facts of each layout, one row per layout.
_FACTS = {
    "v4": _Facts(576, 8, 64, 576, "v4", False),                  # e4m3 nope + bf16 rope, UE8M0 per 64 nope
    "v41": _Facts(512, 16, 32, 512, "v41", False),               # e4m3, UE8M0 per 32
    "v41_fp4": _Facts(256, 32, 16, 256, "v41_fp4", False),       # e2m1 two per byte, e4m3 scale per 16
    "uniform_fp8": _Facts(512, 0, 512, 512, "uniform_fp8", False),  # e4m3, unit scale kept outside
    "v41_new": _Facts(512, 16, 32, 528, "v41", True),
    "v41_fp4_new": _Facts(256, 32, 16, 288, "v41_fp4", True),
}


class KVLayout(str, enum.Enum):
    """A paged KV cache layout; a ``str`` whose value is the layout's name (``"v41"``, contract §10.1)."""

    V4 = "v4"
    V41 = "v41"
    V41_FP4 = "v41_fp4"
    UNIFORM_FP8 = "uniform_fp8"
    V41_NEW = "v41_new"
    V41_FP4_NEW = "v41_fp4_new"

    @property
    def _facts(self) -> _Facts:
        return _FACTS[self.value]

    @property
    def is_interleaved(self) -> bool:
        return self._facts.interleaved

    @property
    def encoding(self) -> KVLayout:
        """The block-split layout storing a token with the same bytes (itself unless interleaved)."""
        return KVLayout(self._facts.encoding)

    @property
    def data_bytes(self) -> int:
        return self._facts.data_bytes

    @property
    def scale_bytes(self) -> int:
        return self._facts.scale_bytes

    @property
    def tile_size(self) -> int:
        """Values sharing one scale (``uniform_fp8``: the whole row, its unit scale kept outside)."""
        return self._facts.tile_size

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def page_align(self) -> int:
        return self._facts.page_align

    @property
    def is_fp4(self) -> bool:
        """Whether the values are e2m1 codes (``v41_fp4`` encoding)."""
        return self.encoding is KVLayout.V41_FP4

    @property
    def cpp_name(self) -> str:
        """The enumerator of the kernels' ``enum class KVLayout`` (``kV41Fp4``)."""
        return "k" + "".join(part.capitalize() for part in self.name.split("_"))

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of ``page_size`` tokens (the cache's row stride):
        ``ceil(page_size · bytes_per_token / page_align) · page_align``."""
        return -(-page_size * self.bytes_per_token // self.page_align) * self.page_align

    def row_addressing(self, page_size: int) -> tuple[int, int, int]:
        """``(data_stride, scale_base, scale_stride)``: inside a page, slot ``i``'s data starts at byte
        ``i · data_stride`` and its scales at ``scale_base + i · scale_stride``."""
        if self.is_interleaved:
            return self.bytes_per_token, self.data_bytes, self.bytes_per_token
        return self.data_bytes, page_size * self.data_bytes, self.scale_bytes

    def with_interleaved(self, interleaved: bool) -> KVLayout:
        """The layout of this encoding in the block-split (False) or interleaved (True) arrangement."""
        for layout in KVLayout:
            if layout.encoding is self.encoding and layout.is_interleaved == bool(interleaved):
                return layout
        raise ArgumentError(f"layout {self.value!r} has no interleaved arrangement")

    @classmethod
    def parse(cls, value) -> KVLayout:
        """A KVLayout from a KVLayout or its value in any case (``"V41"``); ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(str.lower(value))
            except ValueError:
                pass
        names = ", ".join(repr(layout.value) for layout in cls)
        raise ArgumentError(f"layout must be a KVLayout or one of {names} (any case), got {value!r}")


def is_valid_kv_layout_pair(kv, extra_kv) -> bool:
    """Whether a main cache in layout ``kv`` and an extra compressed cache in ``extra_kv`` can be read
    together: identical layouts, or an fp4-encoded extra cache beside a ``v41``-encoded main cache of
    the same arrangement (contract §10.1)."""
    kv, extra_kv = KVLayout.parse(kv), KVLayout.parse(extra_kv)
    return extra_kv is kv or (kv.encoding is KVLayout.V41 and extra_kv.is_fp4
                               and kv.is_interleaved == extra_kv.is_interleaved)
