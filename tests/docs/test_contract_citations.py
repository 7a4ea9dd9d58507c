"""Every citation of docs/contract.md names a section it has (syntax: the preface of contract.md).

Code, tests and docs cite the contract as the word ``contract``, a section sign and a section number
(``N`` or ``N.M``; the letters themselves stand for the syntax in prose); inside contract.md the
section sign and number alone refer to its own sections. A section sign anywhere else, a citation
of a missing section, and references to the document the contract replaced (its name in capitals,
its numbered "Decisions") all fail. The section sign is written as an escape here, so that this
file passes its own scan.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "contract.md"
SCANNED = [ROOT / "src", ROOT / "tests", ROOT / "docs", ROOT / "README.md"]
TEXT_SUFFIXES = {".py", ".md", ".h", ".cuh", ".sh", ".toml"}

SECTION = "\u00a7"
NUMBER = r"\d+(?:\.\d+)?|N(?:\.M)?"  # N and N.M: the syntax itself, in prose
PLACEHOLDERS = {"N", "N.M"}
CITATION = re.compile(rf"contract {SECTION}({NUMBER})")
OWN_CITATION = re.compile(rf"{SECTION}({NUMBER})")
# The document the contract replaced, by name (not the KernelSpec catalogue SPECS) or by its numbering.
RETIRED = re.compile(r"\bS[P]EC\b|\bDecisions? \d")

CHAPTER = re.compile(r"^## (\d+)\. \S")
SECTION_HEADING = re.compile(r"^### (\d+)\.(\d+) \S")


def contract_sections(text: str) -> set[str]:
    """Section numbers of the contract's headings; raises if a heading breaks the numbering."""
    sections: set[str] = set()
    chapter = None
    for line in text.splitlines():
        if m := CHAPTER.match(line):
            chapter = m.group(1)
            number = chapter
        elif m := SECTION_HEADING.match(line):
            if m.group(1) != chapter:
                raise ValueError(f"section {m.group(1)}.{m.group(2)} is not under chapter {m.group(1)}: {line!r}")
            number = f"{m.group(1)}.{m.group(2)}"
        else:
            continue
        if number in sections:
            raise ValueError(f"section {number} appears twice")
        sections.add(number)
    return sections


def citation_problems(text: str, sections: set[str], own: bool) -> list[str]:
    """Problems of one file's text: unknown sections, stray section signs, retired references.
    `own`: the text is contract.md itself, where bare citations are allowed."""
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        pattern = OWN_CITATION if own else CITATION
        cited = pattern.findall(line)
        problems += [f"{lineno}: cites missing section {n}: {line.strip()}" for n in cited
                     if n not in sections and n not in PLACEHOLDERS]
        if line.count(SECTION) != len(cited):
            problems.append(f"{lineno}: a section sign outside a citation 'contract {SECTION}N.M': {line.strip()}")
        if RETIRED.search(line):
            problems.append(f"{lineno}: refers to the retired specification: {line.strip()}")
    return problems


def scanned_files() -> list[Path]:
    files = []
    for root in SCANNED:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        files += [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and "egg-info" not in str(p)]
    return files


def test_contract_sections_are_numbered_consistently():
    sections = contract_sections(CONTRACT.read_text(encoding="utf-8"))
    assert {"1", "2.2", "4.2", "9.3"} <= sections, sorted(sections)


def test_every_citation_names_an_existing_section():
    sections = contract_sections(CONTRACT.read_text(encoding="utf-8"))
    problems, citations = [], 0
    for path in scanned_files():
        text = path.read_text(encoding="utf-8")
        own = path == CONTRACT
        citations += len((OWN_CITATION if own else CITATION).findall(text))
        problems += [f"{path.relative_to(ROOT)}:{p}" for p in citation_problems(text, sections, own)]
    assert not problems, "\n".join(problems)
    assert citations > 100, f"found only {citations} citations: is the scan looking at the right files?"


def test_the_scan_reports_each_kind_of_problem():
    sections = {"1", "1.2"}
    assert citation_problems(f"see contract {SECTION}1.2 and contract {SECTION}1", sections, own=False) == []
    assert citation_problems(f"cite as contract {SECTION}N.M", sections, own=False) == []
    assert citation_problems(f"see {SECTION}1.2", sections, own=True) == []
    bad = {
        f"see contract {SECTION}1.3": "missing section 1.3",
        f"see contract {SECTION}1.2 and {SECTION}1": "section sign outside",
        f"see {SECTION}1.2": "section sign outside",
        "written from " + "S" + "PEC.md": "retired",
        "zero-filled (" + "Decision" + " 3)": "retired",
    }
    for text, expected in bad.items():
        problems = citation_problems(text, sections, own=False)
        assert len(problems) == 1 and expected in problems[0], (text, problems)
    assert citation_problems(f"{SECTION}1.4 of this document", sections, own=True)[0].startswith("1: cites missing")
