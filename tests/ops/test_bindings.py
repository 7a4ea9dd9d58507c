"""The ops' kernel calls against the C++ entry points they call, by name: each call function's
parameters (ops/binding.py) are the entry point's, in its order. Reads the headers; no compiler, no GPU."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import dsv4jit.ops  # noqa: F401  (imports every op module: their calls register)
from dsv4jit.jit.kernels import SPECS
from dsv4jit.ops import binding

CSRC = Path(dsv4jit.ops.__file__).parent.parent / "csrc"
HEADERS = {path: path.read_text() for path in CSRC.rglob("*.*") if path.suffix in (".cuh", ".h")}


def _block(text: str, start: int) -> str:
    """The text from `start` through the brace that closes the first brace after it."""
    depth, i = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
        i += 1


def _split_top(params: str) -> list[str]:
    """`params` split at the commas outside <>, () and {}."""
    parts, depth, current = [], 0, ""
    for ch in params:
        depth += (ch in "<({") - (ch in ">)}")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


def cpp_parameters(struct: str, method: str) -> list[str]:
    """The parameter names of static method `method` of `struct`, looked up in its bases too."""
    for text in HEADERS.values():
        for m in re.finditer(rf"\bstruct {struct}\b\s*(:[^{{;]*)?\{{", text):
            body = _block(text, m.start())
            found = re.search(rf"static void {method}\(", body)
            if found:
                end = body.index(")", found.end())  # parameters hold no parentheses
                return [re.findall(r"\w+", p)[-1] for p in _split_top(body[found.end():end])]
            base = m.group(1)
            if base:
                name = re.match(r":\s*(?:public\s+)?([\w:]+)", base).group(1).split("::")[-1]
                return cpp_parameters(name, method)
    raise LookupError(f"struct {struct} with a static method {method} not found under {CSRC}")


CASES = [(kernel, export, call, unbound) for kernels, export, call, unbound in binding.CALLS for kernel in kernels]


@pytest.mark.parametrize("kernel,export,call,unbound", CASES, ids=[f"{c[0]}.{c[1]}" for c in CASES])
def test_call_parameters_are_the_entry_points(kernel, export, call, unbound):
    cpp = SPECS[kernel].exports[export]
    struct, method = re.match(r"(?:\w+::)*(\w+)<.*>::(\w+)$", cpp).groups()
    python = [name for name in list(inspect.signature(call).parameters)[1:] if name not in unbound]
    assert python == cpp_parameters(struct, method), f"{call.__module__}.{call.__name__} against {cpp}"


def test_every_fast_path_op_calls_through_a_binding():
    """The kernels behind the ops with an eager fast path each have their call declared."""
    bound = {kernel for kernel, *_ in CASES}
    assert {"store", "compress_c4", "compress_c128", "compress_online", "fused", "fused_online",
            "fused_c4_layer"} <= bound


def test_parameters_are_read_from_the_header_and_its_bases():
    """The parser reads a method of the struct itself, and one a struct inherits (the ring
    compressors' decode comes from CompressorEntryBase)."""
    assert cpp_parameters("NormRopeStoreEntry", "run")[:3] == ["kv", "plan_rows", "norm_weight"]
    assert cpp_parameters("OnlineEntry", "decode") == ["kv_score_buffer", "kv_score_input", "ape", "plan_rows", "out",
                                                      "status"]
