"""The package's layout rules: no import cycle between grpo's top-level parts, not even through
imports inside functions (imports under ``if TYPE_CHECKING`` are for type checkers only)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def part_edges(src: Path, package: str = "grpo") -> dict[str, set[str]]:
    """Top-level part -> the parts it imports (``grpo.a.b`` is part ``a``)."""
    root = src / package
    parts = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if p.is_dir()}
    edges: dict[str, set[str]] = {}
    for file in root.rglob("*.py"):
        mine = file.relative_to(root).parts[0].removesuffix(".py")
        tree = ast.parse(file.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dotted = name.split(".")
                inside = dotted[0] == package and len(dotted) > 1 and dotted[1] in parts
                if inside and dotted[1] != mine:
                    edges.setdefault(mine, set()).add(dotted[1])
    return edges


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in reach(b)})


def test_no_import_cycle_between_top_level_parts() -> None:
    edges = part_edges(SRC)
    assert "training" in edges and "config" in edges  # the scan reads the real package
    assert cycles(edges) == []


def test_the_scan_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import g\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n"
    )
    assert cycles(part_edges(tmp_path, "pkg")) == [("a", "b")]
