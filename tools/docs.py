"""``make docs``: the parts of docs/ generated from the code, between their markers.

- docs/config-reference.md: every setting, from the field docstrings (``grpo.config``);
- docs/architecture.md: every module of the package, from its docstring's first sentence.

tests/integration/test_docs.py checks that the committed pages equal what this writes.

    .venv/bin/python -m tools.docs
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "grpo"


def docstring(path: Path) -> str | None:
    """The module's docstring, or None when it has none."""
    return ast.get_docstring(ast.parse(path.read_text()))


def first_sentence(text: str) -> str:
    """The first sentence of the first paragraph, on one line."""
    paragraph = " ".join(text.split("\n\n")[0].split())
    end = re.search(r"[.!?](?=\s+[A-Z`(]|$)", paragraph)
    return paragraph[: end.end()] if end else paragraph


def modules(package: Path = PACKAGE) -> list[Path]:
    """Every module of the package with code or a docstring: a package's face before its modules."""
    found = [p for p in package.rglob("*.py") if "__pycache__" not in p.parts and p.read_text()]
    return sorted(found, key=lambda p: (p.parent.parts, p.name != "__init__.py", p.name))


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``grpo/training/trainer.py``; a package's face as its folder, ``grpo/config/``."""
    relative = path.relative_to(package.parent)
    return f"{relative.parent}/" if path.name == "__init__.py" else str(relative)


def module_table(package: Path = PACKAGE) -> str:
    """A Markdown table: each module and the first sentence of its docstring."""
    rows = ["| module | what it holds |", "|---|---|"]
    for path in modules(package):
        summary = first_sentence(docstring(path) or "").replace("|", "\\|")
        rows.append(f"| `{module_name(path, package)}` | {summary} |")
    return "\n".join(rows) + "\n"


def config_reference() -> str:
    from grpo.config import reference_markdown

    return reference_markdown()


# page -> (marker name, what goes between its markers)
GENERATED: dict[str, tuple[str, Callable[[], str]]] = {
    "docs/config-reference.md": ("config-reference", config_reference),
    "docs/architecture.md": ("module-table", module_table),
}


def with_block(text: str, marker: str, block: str) -> str:
    """`text` with what lies between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` replaced."""
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    head, rest = text.split(start, 1)
    return head + start + block + end + rest.split(end, 1)[1]


def generated_pages(root: Path = ROOT) -> dict[Path, str]:
    """Every generated page as it should read now."""
    pages = {}
    for page, (marker, make) in GENERATED.items():
        path = root / page
        pages[path] = with_block(path.read_text(), marker, make())
    return pages


def main() -> None:
    for path, text in generated_pages().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"regenerated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
