"""What a run sees: the folders masked with an empty tmpfs, and the interpreter's folders bound
back inside them."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from grpo.sandbox.fork_server import BOOT

# folders a run never sees, besides the trainer's home and working directory
TEMP_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")
SYSTEM_FOLDERS = ("/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin", "/proc", "/sys", "/dev")


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost folder on ``path`` that other users cannot enter (no o+x), if any."""
    for parent in [*reversed(path.parents), path]:
        if parent.is_dir() and not parent.stat().st_mode & 0o001:
            return parent
    return None


def interpreter_folders() -> list[Path]:
    """Folders the run's Python must read: its prefixes and the boot code's folder. The trainer's
    other import paths (a project folder, pytest's test folder) may hold data or tests, so they
    stay hidden: the sandboxed interpreter runs isolated (-I) and imports nothing from them."""
    roots = {Path(p).resolve() for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    roots.add(BOOT.parent.resolve())
    return sorted(roots)


def mount_plan(as_root: bool) -> dict[str, list[str]]:
    """Folders to mask with an empty tmpfs, and interpreter folders to bind back inside them.

    Masked: the temp folders, the trainer's home and working directory, and as root the closed
    folders holding the interpreter (a pyenv under /root, mode 700, is invisible to a per-run uid).
    Never masked: a folder holding system files or one inside an interpreter folder.
    """
    roots = interpreter_folders()
    wanted = [Path(p) for p in TEMP_FOLDERS] + [Path.home(), Path.cwd()]
    if as_root:
        wanted += [c for c in map(_closed_ancestor, roots) if c is not None]
    masks: list[Path] = []
    for folder in sorted({p.resolve() for p in wanted if p.is_dir()}, key=lambda p: len(p.parts)):
        system = any(Path(s).is_relative_to(folder) for s in SYSTEM_FOLDERS)
        inside_root = any(folder.is_relative_to(r) for r in roots)
        nested = any(folder.is_relative_to(m) for m in masks)
        if folder != Path("/") and not system and not inside_root and not nested:
            masks.append(folder)
    return {"masks": [str(m) for m in masks], "roots": [str(r) for r in roots]}


@functools.lru_cache(maxsize=8)
def cached_mount_plan(as_root: bool, *where: object) -> dict[str, list[str]]:
    """``mount_plan`` once per import path, working directory and home (it stats many folders)."""
    return mount_plan(as_root)
