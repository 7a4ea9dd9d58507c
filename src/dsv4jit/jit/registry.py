"""What can be built: kernel specs, their typed template parameters, and canonical variants.

A :class:`KernelSpec` names a header under ``csrc/``, the C++ entry points to export (as templates
over the spec's parameters) and the default "serving set" to precompile. A :class:`Variant` is one
instantiation; its id (``compress_c4[head_dim=512,state=fp32,input=fp32,output=fp32,pdl=1]``) and
slug are derived from the schema, never typed by hand.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

#: Our dtype names and the C++ types of ``csrc/common/types.cuh``.
DTYPE_CPP = {"fp32": "float", "bf16": "dsv4::bf16_t", "fp16": "dsv4::fp16_t"}


@dataclass(frozen=True)
class Param:
    """One template parameter: its name, kind (dtype, int, bool, enum) and allowed values."""

    name: str
    kind: str  # "dtype", "int", "bool", or "enum" (choices are names, cpp_names their C++ spelling)
    choices: tuple
    cpp_names: tuple = ()

    def __post_init__(self) -> None:
        if self.kind not in ("dtype", "int", "bool", "enum"):
            raise ValueError(f"param {self.name}: unknown kind {self.kind!r}")
        if (self.kind == "enum") != bool(self.cpp_names) or len(self.cpp_names) not in (0, len(self.choices)):
            raise ValueError(f"param {self.name}: enum params need one C++ name per choice")

    def canonical(self, value: Any) -> Any:
        if self.kind == "bool":
            words = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False,
                     "no": False}
            if isinstance(value, str) and value.strip().lower() in words:
                value = words[value.strip().lower()]
            elif value in (0, 1) and not isinstance(value, str):
                value = bool(value)
            else:
                raise ValueError(f"parameter {self.name!r} must be a boolean (0/1, true/false), got {value!r}")
        elif self.kind == "int":
            value = int(value)
        if value not in self.choices:
            raise ValueError(f"parameter {self.name!r} must be one of {list(self.choices)}, got {value!r}")
        return value

    def text(self, value: Any) -> str:
        """Value as written in variant ids and slugs."""
        return str(int(value)) if self.kind == "bool" else str(value)

    def cpp(self, value: Any) -> str:
        """Value as a C++ template argument."""
        if self.kind == "dtype":
            return DTYPE_CPP[value]
        if self.kind == "enum":
            return self.cpp_names[self.choices.index(value)]
        if self.kind == "bool":
            return "true" if value else "false"
        return str(value)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    header: str  # relative to csrc/
    params: tuple[Param, ...]
    exports: Mapping[str, str]  # python name -> C++ function, with {param} placeholders
    # what precompile builds by default: parameter values, without the launch options (pdl) that
    # runtime.variant sets as the ops do
    serving: tuple[Mapping[str, Any], ...] = ()
    target: str = "cuda"  # "cuda" (nvcc, one GPU arch) or "host" (host C++ compiler only)
    doc: str = ""
    # combinations the templates reject: returns why (a message), or None when the values are fine
    reject: Optional[Callable[[Mapping[str, Any]], Optional[str]]] = None
    _by_name: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name.update({p.name: p for p in self.params})

    def param(self, name: str) -> Param | None:
        return self._by_name.get(name)

    def variant(self, **values: Any) -> "Variant":
        unknown = set(values) - set(self._by_name)
        if unknown:
            raise ValueError(f"kernel {self.name!r} has no parameter(s) {sorted(unknown)}; "
                             f"parameters: {[p.name for p in self.params]}")
        missing = [p.name for p in self.params if p.name not in values]
        if missing:
            raise ValueError(f"kernel {self.name!r}: missing parameter(s) {missing}")
        canon = tuple((p.name, p.canonical(values[p.name])) for p in self.params)
        why = self.reject(dict(canon)) if self.reject is not None else None
        if why:
            raise ValueError(f"kernel {self.name!r}: {why}")
        return Variant(self, canon)

    def all_variants(self) -> list["Variant"]:
        names = [p.name for p in self.params]
        combos = (dict(zip(names, c)) for c in itertools.product(*(p.choices for p in self.params)))
        return [self.variant(**c) for c in combos if self.reject is None or not self.reject(c)]


@dataclass(frozen=True)
class Variant:
    spec: KernelSpec
    values: tuple[tuple[str, Any], ...]

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def id(self) -> str:
        inner = ",".join(f"{n}={self.spec._by_name[n].text(v)}" for n, v in self.values)
        return f"{self.spec.name}[{inner}]" if inner else self.spec.name

    @property
    def slug(self) -> str:
        parts = [self.spec.name] + [
            (n if v is True else f"no{n}") if isinstance(v, bool) else str(v) for n, v in self.values]
        return "__".join([parts[0], "_".join(parts[1:])]) if len(parts) > 1 else parts[0]

    def cpp_args(self) -> dict[str, str]:
        return {n: self.spec._by_name[n].cpp(v) for n, v in self.values}

    def exports(self) -> dict[str, str]:
        args = self.cpp_args()
        return {py: cpp.format(**args) for py, cpp in self.spec.exports.items()}

    def wrapper_source(self) -> str:
        """The generated translation unit: the kernel header plus one export line per entry."""
        lines = [f"// dsv4jit generated wrapper for {self.id}", f'#include "{self.spec.header}"', ""]
        lines += [f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({py}, ({cpp}));" for py, cpp in self.exports().items()]
        return "\n".join(lines) + "\n"


def parse_variant_id(text: str, specs: Mapping[str, KernelSpec]) -> Variant:
    """Inverse of :attr:`Variant.id` (``name[k=v,...]``); used by the CLI."""
    name, _, rest = text.partition("[")
    if name not in specs:
        raise ValueError(f"unknown kernel {name!r}; known: {sorted(specs)}")
    values: dict[str, str] = {}
    if rest:
        if not rest.endswith("]"):
            raise ValueError(f"malformed variant id {text!r}: expected name[k=v,...]")
        for item in filter(None, rest[:-1].split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"malformed variant id {text!r}: {item!r} is not k=v")
            values[key.strip()] = value.strip()
    return specs[name].variant(**values)


def unique(variants: Iterable[Variant]) -> list[Variant]:
    seen: dict[str, Variant] = {}
    for v in variants:
        seen.setdefault(v.id, v)
    return list(seen.values())
