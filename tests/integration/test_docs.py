"""Docs that cannot point at nothing: every relative link in the READMEs and docs/ resolves, every
docs/ path and every section named in code, recipes, docs and the Makefile exists, and the
generated parts of docs/ are current (``make docs``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import docs

ROOT = docs.ROOT
PAGES = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
# where pointers are written: the pages, the package (recipes included), benchmarks, tools,
# tests, the Makefile and pyproject.toml
SOURCES = [
    *PAGES,
    *(p for d in ("src", "benchmarks", "tools", "tests") for p in sorted((ROOT / d).rglob("*"))),
    ROOT / "Makefile",
    ROOT / "pyproject.toml",
]
SOURCES = [
    p
    for p in SOURCES
    if p.suffix in {".md", ".py", ".yaml", ".toml", ""}
    and p.is_file()
    and "__pycache__" not in p.parts
    and p != Path(__file__)
]

LINK = re.compile(r"\]\(([^()\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*[\w/]|README\.md)(#[\w-]+)?")
# README, "Section" / README ("Section") / docs/page.md, "Section": the section is a heading
SECTION = re.compile(r"(?<![\w./-])(README|docs/[\w./-]+\.md)(?:'s)?,? \(?\"([^\"\n]+)\"")
# docs/page.md, Section: a section named without quotes, which no test could check
UNQUOTED = re.compile(r"(?<![\w./-])(?:README|docs/[\w./-]+\.md),? [A-Z][a-z]")
BARE_README = re.compile(r"(?<![\w./-])README(?![\w.\]])")  # not a link's text


def headings(page: Path) -> list[str]:
    """The page's headings, outside code blocks, as written (backticks dropped)."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} +(.+?) *#*$", line)):
            found.append(match.group(1).replace("`", ""))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(page):
        base = slug(heading)
        out.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return out


def _where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1}"


def _target_problem(target: Path, anchor: str | None) -> str | None:
    if not target.exists():
        return f"no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading #{anchor} in {target.relative_to(ROOT)}"
    return None


def test_slugs_are_githubs() -> None:
    assert slug("Precision: model.precision: auto") == "precision-modelprecision-auto"
    assert slug("R1-Zero on a base model (Gemma 3 270M)") == "r1-zero-on-a-base-model-gemma-3-270m"


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        text = page.read_text()
        for match in LINK.finditer(text):
            link = match.group(1)
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if problem := _target_problem(target, anchor or None):
                broken.append(f"{_where(page, text, match.start())}: ({link}): {problem}")
    assert not broken, "\n".join(broken)


def test_every_docs_path_named_exists() -> None:
    broken = []
    for source in SOURCES:
        text = source.read_text()
        for match in DOCS_PATH.finditer(text):
            target = ROOT / match.group(1).rstrip(".")
            anchor = match.group(2)[1:] if match.group(2) else None
            if problem := _target_problem(target, anchor):
                broken.append(f"{_where(source, text, match.start())}: {match.group()}: {problem}")
    assert not broken, "\n".join(broken)


def test_every_section_named_exists() -> None:
    broken = []
    for source in SOURCES:
        text = source.read_text()
        for match in SECTION.finditer(text):
            page = ROOT / ("README.md" if match.group(1) == "README" else match.group(1))
            if not page.exists():
                continue  # test_every_docs_path_named_exists says so
            if match.group(2).lower() not in {h.lower() for h in headings(page)}:
                where = _where(source, text, match.start())
                broken.append(f"{where}: {match.group()}: no such heading in {page.name}")
    assert not broken, "\n".join(broken)


def test_readme_is_named_with_its_section() -> None:
    """A bare "README" points at a page of 250 lines: name the section, or the page in docs/."""
    vague = []
    for source in SOURCES:
        if source.is_relative_to(ROOT / "tests"):
            continue  # tests write README as data
        text = source.read_text()
        for match in BARE_README.finditer(text):
            if not SECTION.match(text, match.start()):
                vague.append(
                    f"{_where(source, text, match.start())}: {text[match.start() :][:60]!r}"
                )
    assert not vague, "\n".join(vague)


def test_sections_are_named_in_quotes() -> None:
    unquoted = []
    for source in SOURCES:
        text = source.read_text()
        for match in UNQUOTED.finditer(text):
            unquoted.append(f"{_where(source, text, match.start())}: {match.group()}")
    assert not unquoted, "\n".join(unquoted)


@pytest.mark.parametrize("page", sorted(docs.GENERATED))
def test_generated_docs_are_current(page: str) -> None:
    path = ROOT / page
    assert path.read_text() == docs.generated_pages()[path], "regenerate with: make docs"


def test_every_module_says_what_it_holds() -> None:
    missing = [docs.module_name(p) for p in docs.modules() if not docs.docstring(p)]
    assert not missing, f"modules without a docstring: {missing}"
