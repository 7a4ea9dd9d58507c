"""A kernel family as the Python side declares it: the name warmup knows it by and the variants a
model configuration reaches.

The module that binds a family's kernels (``plan.py``, ``ops/*.py``, ``compat.py``) has one function
that picks the variant of a call, ``kernel(...) -> (kernel name, parameters)``, and declares its
`Family` with a reach built from that same function, so that `dsv4jit.warmup` builds exactly what
the calls will load. ``preload.FAMILIES`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from . import geometry

#: (kernel name, parameters): what ``runtime.function(kernel, export, device, **parameters)`` loads.
KernelChoice = tuple[str, dict]


@dataclass(frozen=True)
class ModelConfig:
    """What warmup knows of a model: compress ratio -> head dims of its compressors, the kernels'
    dtype names (``fp32``, ...) of state, input and compressed rows, the store flags, and whether the
    target is the host (where the compressors run as torch references: ``head_dims`` is empty)."""

    head_dims: Mapping[int, tuple[int, ...]]
    state: str = "fp32"
    input: str = "fp32"
    output: str = "fp32"
    use_fp4: bool = False
    bf16_store: bool = False
    host: bool = False
    layouts: Mapping[int, str] = field(default_factory=dict)  # ratio -> KVLayout value of its latent (else v4)

    def pairs(self) -> list[tuple[int, int]]:
        """(compress ratio, head_dim) of every compressor."""
        return [(ratio, hd) for ratio, dims in self.head_dims.items() for hd in dims]

    def layout(self, ratio: int) -> str:
        """The KVLayout value of the latent cache of the ratio's layers."""
        return self.layouts.get(ratio, "v4")

    def store_format(self, ratio: int, head_dim: int) -> str:
        """The cache format of the rows of `head_dim` on the ratio's layers: use_fp4 applies to the
        indexer, bf16_store and the layout to the latent."""
        latent = head_dim == geometry.V4_HEAD_DIM
        return geometry.store_format(head_dim, use_fp4=self.use_fp4 and head_dim == geometry.INDEXER_HEAD_DIM,
                                     bf16_store=self.bf16_store and latent,
                                     layout=self.layout(ratio) if latent else "v4", head_dim_arg="head_dims")


@dataclass(frozen=True)
class Family:
    """`name`: the entry of warmup's ``ops``; `reach(config)`: the kernel choices of the family's
    calls for a model configuration."""

    name: str
    reach: Callable[[ModelConfig], Iterable[KernelChoice]]
