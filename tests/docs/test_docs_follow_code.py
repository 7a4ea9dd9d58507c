"""The docs against the code's own lists, so that what the code gains (a public name, an op, a
warm-up family, a command-line option, a module, a header, a custom op) fails here until the docs
name it, and a warm-up family, an option or a custom op it loses fails here until they drop it:

* every public name has a signature in docs/api.md, and every public op a row of the call table of
  docs/migration.md, where no row calls a name dsv4jit has "none";
* api.md's `warmup` lists exactly ``preload.FAMILIES``;
* the command line: docs/jit.md, section 5, is its reference; each command's synopsis there names
  exactly the options (and their choices) of the parser ``cli.build_parser`` builds, and api.md's
  table has a row per command;
* docs/overview.md names every module of ``ops/``, ``jit/`` and ``reference/``, every kernel header
  outside ``common/`` (docs/jit.md's table holds those), and the registered custom ops;
* the README's sample demo output is what ``python -m dsv4jit demo`` prints (clock figures aside),
  and its variant count for ``precompile --arch 9.0a`` is what ``list --arch 9.0a`` selects.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4jit
import dsv4jit.ops
from dsv4jit import cli, preload
from helpers.markdown import code_blocks, section, table_rows

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "dsv4jit"
CSRC = PACKAGE / "csrc"


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


PUBLIC_OPS = sorted(dsv4jit.ops.__all__)
PUBLIC_NAMES = sorted({n for n in dsv4jit.__all__ if n != "__version__"} | set(PUBLIC_OPS))


# ---------------------------------------------------------------------------------------------
# Public names and ops: api.md, migration.md
# ---------------------------------------------------------------------------------------------

def test_every_public_name_has_a_signature_in_the_api_reference():
    signatures = "\n".join(code_blocks(read("docs/api.md"), "python"))
    missing = [n for n in PUBLIC_NAMES if not re.search(rf"^(?:dsv4jit\.)?{n}\(", signatures, re.M)]
    assert not missing, f"docs/api.md has no signature (a python block line `name(...`) for {missing}"


def call_table() -> list[list[str]]:
    """(upstream call, dsv4jit call, what to know) rows of the migration guide's call table."""
    rows = table_rows(section(read("docs/migration.md"), "## Call by call"))
    assert len(rows) > 5 and all(len(r) == 3 for r in rows), "the call table of docs/migration.md was not found"
    return rows


def test_every_public_op_has_a_row_in_the_migration_call_table():
    called = {name for _, dsv4jit_call, _ in call_table() for name in re.findall(r"`dsv4jit\.(\w+)\(", dsv4jit_call)}
    missing = [op for op in PUBLIC_OPS if op not in called]
    assert not missing, f"docs/migration.md's call table has no row calling `dsv4jit.<op>(...)` for {missing}"


def test_no_row_of_the_migration_call_table_calls_what_dsv4jit_has_none():
    wrong = [(upstream, dsv4jit_call) for upstream, dsv4jit_call, _ in call_table()
             if re.search(r"\bnone\b|not implemented", dsv4jit_call, re.I)
             and any(hasattr(dsv4jit, name) for name in re.findall(r"`(\w+)", upstream))]
    assert not wrong, f"docs/migration.md says 'none' for calls dsv4jit has: {wrong}"


# ---------------------------------------------------------------------------------------------
# warmup's op families: api.md
# ---------------------------------------------------------------------------------------------

def test_the_warmup_reference_lists_every_op_family():
    [ops_row] = [row for row in table_rows(section(read("docs/api.md"), "## `warmup`")) if row[0] == "`ops`"]
    documented = re.findall(r'`"(\w+)"`', ops_row[1])
    assert sorted(documented) == sorted(preload.FAMILIES), "docs/api.md's warmup `ops` row against preload.FAMILIES"


# ---------------------------------------------------------------------------------------------
# The command line: docs/jit.md, section 5 (the reference), and api.md's table of commands
# ---------------------------------------------------------------------------------------------

def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def options_in(text: str) -> set[str]:
    """The option strings a piece of documentation names (`-j`, `--dry-run`)."""
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text.replace("python -m dsv4jit", "")))


PARSER = cli.build_parser()


def cli_reference() -> str:
    return section(read("docs/jit.md"), "## 5. The CLI")


def synopsis(command: str) -> str:
    """The lines of the synopsis blocks of `command` in docs/jit.md, section 5."""
    blocks = [b for b in code_blocks(section(cli_reference(), f"### `{command}`"), "")
              if b.startswith(f"python -m dsv4jit {command}")]
    assert blocks, f"docs/jit.md, section 5, has no synopsis block for {command!r}"
    return "\n".join(blocks)


@pytest.mark.parametrize("command", sorted(commands(PARSER)))
def test_the_cli_reference_gives_every_option_of_each_command(command):
    parser, text = commands(PARSER)[command], synopsis(command)
    named = options_in(text)
    missing, missing_choices = [], []
    for action in documented_actions(parser):
        if not action.option_strings:  # a positional: its placeholder
            placeholder = (action.metavar or action.dest).upper()
            missing += [] if placeholder in text else [placeholder]
        elif not named & set(action.option_strings):
            missing.append(action.option_strings[-1])
        missing_choices += [f"{(action.option_strings or [action.dest])[-1]} {c}" for c in action.choices or ()
                            if not re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", text)]
    assert not missing, f"docs/jit.md's synopsis of {command!r} lacks {missing}"
    assert not missing_choices, f"docs/jit.md's synopsis of {command!r} lacks the choices {missing_choices}"
    known = {o for a in parser._actions for o in a.option_strings}
    assert named <= known, f"docs/jit.md's synopsis of {command!r} names options it lacks: {sorted(named - known)}"


def test_the_cli_reference_gives_the_options_before_any_command():
    before_commands = cli_reference().split("\n### ", 1)[0]
    missing = [a.option_strings[-1] for a in documented_actions(PARSER)
               if a.option_strings and not options_in(before_commands) & set(a.option_strings)]
    assert not missing, f"docs/jit.md, section 5, does not name {missing}"


def test_the_api_reference_has_a_row_per_command_naming_only_its_options():
    rows = table_rows(section(read("docs/api.md"), "## Command line"))
    by_command = {row[0].strip("`"): row[1] for row in rows}
    assert sorted(by_command) == sorted(commands(PARSER)), "docs/api.md's command table against the parser's commands"
    for command, does in by_command.items():
        known = {o for a in commands(PARSER)[command]._actions for o in a.option_strings}
        assert options_in(does) <= known, f"docs/api.md's row of {command!r} names options it lacks"


# ---------------------------------------------------------------------------------------------
# The architecture page: modules, kernel headers, custom ops
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["ops", "jit", "reference"])
def test_the_overview_names_every_module_of_a_layer(folder):
    layers = table_rows(section(read("docs/overview.md"), "## Layers of the package"))
    files = " ".join(row[1] for row in layers if f"{folder}/" in row[1])
    assert files, f"no row of docs/overview.md's layer table names {folder}/"
    modules = sorted(p.name for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if f"`{m}`" not in files and f"{folder}/{m}`" not in files]
    assert not missing, f"docs/overview.md's layer table does not name {folder}/{missing}"


def kernel_tree() -> dict[str, str]:
    """Entry of the overview's csrc/ tree (a folder such as ``fused/``, or a file) -> its text."""
    [tree] = [b for b in code_blocks(read("docs/overview.md"), "text") if b.startswith("csrc/\n")]
    entries: dict[str, str] = {}
    for line in tree.splitlines()[1:]:
        if not line.startswith("   "):  # a new entry; deeper indents continue the one above
            name = line.split()[0]
        entries[name] = entries.get(name, "") + line + "\n"
    return entries


def test_the_overview_kernel_tree_names_every_header():
    entries = kernel_tree()
    missing = []
    for header in sorted(CSRC.rglob("*.*")):
        parts = header.relative_to(CSRC).parts
        if parts[0] == "common":  # docs/jit.md's support-header table (test_docs.py)
            continue
        text = entries.get(parts[0] if len(parts) == 1 else parts[0] + "/", "")
        if not re.search(rf"(?<![\w/:.]){re.escape(header.stem)}(?:\.cuh|\.h)?(?=[,;:)\s]|$)", text, re.M):
            missing.append("/".join(parts))
    assert not missing, f"docs/overview.md's csrc/ tree does not name {missing}"


def registered_custom_ops() -> set[str]:
    """The ops registered in torch's ``dsv4jit`` namespace (importing dsv4jit.ops registers them all)."""
    return {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv4jit::")}


def test_the_docs_list_every_custom_op():
    registered = registered_custom_ops()
    assert {"compress", "norm_rope_store"} <= registered
    [listed] = re.findall(r"`torch\.ops\.dsv4jit\.\{([^}]*)\}`", read("docs/overview.md"))
    assert sorted(listed.split(", ")) == sorted(registered), "docs/overview.md's custom ops against torch.ops.dsv4jit"
    spans = set(re.findall(r"`(?:torch\.ops\.dsv4jit\.)?(\w+)`", section(read("docs/api.md"), "## torch integration")))
    assert not registered - spans, f"docs/api.md's torch integration does not name {sorted(registered - spans)}"


# ---------------------------------------------------------------------------------------------
# The README's sample output and figures
# ---------------------------------------------------------------------------------------------

DECIMAL = re.compile(r"\d[\d,]*\.\d+")


def timeless(report: str) -> list[str]:
    """The demo's report with what depends on the clock masked: every decimal figure (seconds, µs) and
    the phase table's last column (tokens/s); runs of spaces as one (the columns are right-aligned)."""
    lines, in_table = [], False
    for line in report.splitlines():
        in_table = line.startswith("phase ") or (in_table and bool(line.strip()))
        if in_table and not line.startswith("phase "):
            line = line.rsplit(None, 1)[0] + " #"
        lines.append(" ".join(DECIMAL.sub("#", line).split()))
    return lines


def test_the_readme_demo_output_is_what_the_demo_prints(host_planner):
    [block] = re.findall(r"^<!-- demo-output: .*-->\n```text\n(.*?)^```$", read("README.md"), re.S | re.M)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # what the README shows: a machine without a GPU
    res = subprocess.run([sys.executable, "-m", "dsv4jit", "demo"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    printed = timeless(res.stdout)
    assert printed[-1] == "every state and cache matched" and any(line.startswith("prefill ") for line in printed)
    assert timeless(block) == printed, f"README.md's demo output is not what the demo prints:\n{res.stdout}"


def test_the_readme_variant_count_is_what_precompile_selects(jit_env, capsys):
    [count] = re.findall(r"`python -m dsv4jit precompile --arch 9\.0a`: (\d+) variants", read("README.md"))
    assert cli.main(["list", "--arch", "9.0a", "--json"]) == 0
    selected = json.loads(capsys.readouterr().out)["variants"]
    assert int(count) == len(selected), f"README.md says {count} variants; list --arch 9.0a selects {len(selected)}"
