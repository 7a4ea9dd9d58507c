"""What the README and docs/ state that a test can hold them to: relative links and their anchors
resolve, the repository files they name exist (scripts, examples, tests), the README's code is an
excerpt of an example that runs (tests/ops/test_examples.py runs it),
the migration guide's code parses and names only what dsv4jit has, its fallback switch picks
dsv4jit, the CI row of the tested-versions table is the environment CI runs in, and the
support-header table of docs/jit.md lists every csrc/common/ header and only names they hold."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from dsv4jit.jit import toolchain
from helpers.jit_env import REAL_NVCC
from helpers.markdown import code_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(doc):
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{doc.name}: {broken}"


#: A file of this repository named in the text: under scripts/, examples/, tests/ or a dot-folder such as
#: .ci/ (the virtual environment the README has a reader create aside).
REPO_FILE = re.compile(r"(?<![\w/.-])((?:\.(?!venv/)[\w-]+|scripts|examples|tests)/[\w./-]*\w)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_files_a_doc_names_are_in_the_repository(doc):
    named = REPO_FILE.findall(doc.read_text(encoding="utf-8"))
    assert not [path for path in named if not (ROOT / path).exists()], doc.name


def test_the_readme_code_is_an_excerpt_of_the_cpu_example():
    [snippet] = code_blocks((ROOT / "README.md").read_text(encoding="utf-8"), "python")
    assert snippet in (ROOT / "examples" / "compress_cpu.py").read_text(encoding="utf-8")


def dsv4jit_names(tree: ast.AST) -> set[str]:
    """Dotted names a piece of code takes from dsv4jit: imports and attribute chains on the package."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dsv4jit":
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Attribute):
            chain = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "dsv4jit":
                names.add(".".join(["dsv4jit", *chain]))
    return names


def resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_the_migration_guide_names_what_dsv4jit_has():
    text = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    blocks = code_blocks(text, "python")
    names = {name for block in blocks for name in dsv4jit_names(ast.parse(block))}
    names |= set(re.findall(r"`(dsv4jit(?:\.\w+)+)", text))  # names in the prose and the table
    assert {"dsv4jit.compress_and_store", "dsv4jit.CompressorPrefillPlan.generate_online"} <= names
    for name in sorted(names):
        resolve(name)


def test_the_fallback_switch_of_the_migration_guide_picks_dsv4jit(monkeypatch):
    import dsv4jit

    [switch] = [b for b in code_blocks((ROOT / "docs" / "migration.md").read_text(encoding="utf-8"), "python")
                if "def compressor_kernels" in b]
    monkeypatch.delenv("SERVER_COMPRESSOR_KERNELS", raising=False)
    scope: dict = {}
    exec(compile(switch, "migration.md", "exec"), scope)
    assert scope["kernels"] is dsv4jit and scope["compress_forward"] is dsv4jit.compress_forward
    monkeypatch.setenv("SERVER_COMPRESSOR_KERNELS", "upstream")
    with pytest.raises(ImportError, match="sglang"):  # the upstream kernels are not installed here
        scope["compressor_kernels"]()


def versions_table() -> dict[str, dict[str, str]]:
    """The README's tested-versions table: row name -> column -> cell."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("<!-- tested-versions -->\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    return {row[0]: dict(zip(header, row)) for row in rows}


@pytest.mark.full
def test_the_ci_row_of_the_tested_versions_is_this_environment():
    """CI runs the full suite: there the row must say what is installed."""
    ci = next(row for name, row in versions_table().items() if name.startswith("CI"))
    import torch

    assert ci["Python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert ci["torch"].split()[0] == torch.__version__.split("+")[0]
    assert ci["apache-tvm-ffi"] == importlib.metadata.version("apache-tvm-ffi")
    if REAL_NVCC is not None:
        version = toolchain.toolchain(need_cuda=True).nvcc_version
        assert f"release {ci['CUDA toolkit']}," in version, version


# ---------------------------------------------------------------------------------------------
# The support-header table of docs/jit.md against csrc/
# ---------------------------------------------------------------------------------------------

CSRC = ROOT / "src" / "dsv4jit" / "csrc"
HEADER_FILE = re.compile(r"^[\w/]+\.(?:h|cuh)$")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def support_header_rows() -> list[tuple[list[Path], str]]:
    """(headers, provides) of each row of the table under "Support headers in `csrc/common/`"."""
    text = (ROOT / "docs" / "jit.md").read_text(encoding="utf-8")
    table = text.split("Support headers in `csrc/common/`:", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:  # past the heading and the rule
        first, provides = line.strip("|").split("|", 1)
        rows.append(([CSRC / "common" / n if "/" not in n else CSRC / n for n in re.findall(r"`([^`]+)`", first)],
                     provides))
    return rows


def named_identifiers(span: str) -> list[str]:
    """The names a code span gives: `load_vec<N>` names load_vec, `Dim::any()` Dim and any,
    `.shape({...})` shape; what stands inside (), {} and <> are arguments, not names."""
    outer, depth = [], 0
    for ch in span:
        depth += ch in "({<"
        if depth == 0:
            outer.append(ch)
        depth -= ch in ")}>" and depth > 0
    return IDENTIFIER.findall("".join(outer))


def test_the_support_header_table_names_what_the_headers_hold():
    rows = support_header_rows()
    assert len(rows) >= 10, "the support-header table of docs/jit.md was not found"
    listed = {h for headers, _ in rows for h in headers}
    missing_headers = [str(h.relative_to(CSRC)) for h in listed if not h.is_file()]
    assert not missing_headers, f"docs/jit.md names headers csrc/ lacks: {missing_headers}"
    unlisted = sorted(p.name for p in (CSRC / "common").iterdir() if p not in listed)
    assert not unlisted, f"csrc/common/ headers missing from the table of docs/jit.md: {unlisted}"
    absent, checked = [], 0
    for headers, provides in rows:
        source = "\n".join(h.read_text(encoding="utf-8") for h in headers)
        for span in re.findall(r"`([^`]+)`", provides):
            if HEADER_FILE.match(span):  # a neighbour file of the row's header
                if not (headers[0].parent / span).is_file():
                    absent.append(f"{headers[0].name}: file {span}")
                continue
            for name in named_identifiers(span):
                checked += 1
                if not re.search(rf"\b{name}\b", source):
                    absent.append(f"{', '.join(h.name for h in headers)}: {name} (from `{span}`)")
    assert not absent, "docs/jit.md's support-header table names what the headers lack:\n" + "\n".join(absent)
    assert checked > 80, f"only {checked} names checked: is the table parsed?"


def test_the_support_header_check_reads_names_from_code_spans():
    assert named_identifiers("load_vec<N>") == ["load_vec"]
    assert named_identifiers("Dim::any()") == ["Dim", "any"]
    assert named_identifiers(".aligned(bytes = 16)") == ["aligned"]
    assert named_identifiers("DTypeInfo<T>::dtype") == ["DTypeInfo", "dtype"]
    assert named_identifiers("launch(op, device, {grid, block, smem}, pdl, kernel, args...)") == ["launch"]
    assert named_identifiers("cluster > 1") == ["cluster"]
    assert named_identifiers("; ") == []
