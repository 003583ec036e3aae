"""A cgroup per sandboxed process tree, where the machine lets the trainer create one (cgroup v2
with the memory controller, else v1's memory and pids hierarchies): its memory and task limits,
its out-of-memory count, and killing and removing it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from grpo.sandbox.limits import Limits

_COUNTER = itertools.count()


@functools.cache
def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Hierarchy ('unified', 'memory', 'pids') -> (mount point, mount root)."""
    found: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fstype, _, options = after.split()[:3]
        root, point = before.split()[3:5]
        if fstype == "cgroup2":
            found["unified"] = (point, root)
        elif fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options.split(","):
                    found[controller] = (point, root)
    return found


def _own_cgroup(hierarchy: str) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if (hierarchy == "unified" and controllers == "") or hierarchy in names:
            return path
    return None


def _new_cgroup(hierarchy: str) -> Path | None:
    mount = _cgroup_mounts().get(hierarchy)
    own = _own_cgroup(hierarchy)
    if mount is None or own is None:
        return None
    point, root = mount
    relative = os.path.relpath(own, root) if own != root else ""
    folder = Path(point, relative, f"grpo-sandbox-{os.getpid()}-{next(_COUNTER)}")
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder


@dataclass
class Cgroup:
    """One run's cgroup folders (v2: one; v1: memory and pids) and how to limit and empty them."""

    folders: list[Path]
    oom_file: str

    def kill(self) -> None:
        for folder in self.folders:
            if (folder / "cgroup.kill").exists():
                (folder / "cgroup.kill").write_text("1")
            for _ in range(100):  # forks racing the sweep are caught by the next round
                pids = (folder / "cgroup.procs").read_text().split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def oom_killed(self) -> bool:
        text = (self.folders[0] / self.oom_file).read_text()
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for folder in self.folders:
            for _ in range(100):  # the last tasks leave the cgroup just after they die
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def make_cgroup(limits: Limits) -> Cgroup | None:
    """A cgroup capping the memory (all of it: heap, tmpfs, memfds, page tables) and tasks of
    one process tree, or None where the trainer cannot create one."""
    made: list[Path] = []
    try:
        unified = _new_cgroup("unified")
        if unified is not None:
            made.append(unified)
            if (unified / "memory.max").exists():
                _write_limits(unified, limits, "memory.max", "memory.swap.max", "pids.max")
                return Cgroup(made, "memory.events")
            made.pop().rmdir()
        memory = _new_cgroup("memory")
        if memory is None:
            return None
        made.append(memory)
        _write_limits(memory, limits, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        pids = _new_cgroup("pids")
        if pids is not None:
            made.append(pids)
            _write_limits(pids, limits, "pids.max")
        return Cgroup(made, "memory.oom_control")
    except OSError:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        return None


def _write_limits(folder: Path, limits: Limits, *names: str) -> None:
    """Write the limits a cgroup folder offers (swap: none beyond the memory limit)."""
    values = {
        "memory.max": limits.memory_mb << 20,
        "memory.swap.max": 0,
        "memory.limit_in_bytes": limits.memory_mb << 20,
        "memory.memsw.limit_in_bytes": limits.memory_mb << 20,
        "pids.max": limits.max_procs,
    }
    for name in names:
        if (folder / name).exists():
            (folder / name).write_text(str(values[name]))
