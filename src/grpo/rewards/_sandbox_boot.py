"""Sandbox bootstrap: runs as a script inside the child process, before any untrusted code.

It is executed as ``python -I -B _sandbox_boot.py '<json spec>'`` (never imported by the trainer,
stdlib only), applies every restriction it can, reports which ones on its first stderr line, and
then runs ``main.py`` of the working directory in-process. Order matters:

1. network: a fresh network namespace (root: ``unshare(CLONE_NEWNET)``; otherwise a user namespace
   plus a network namespace where the kernel allows it); the new namespace has no interface up;
2. resource limits: CPU seconds, address space, file size, process count, no core files;
3. privileges: as root, where the interpreter lives in a folder closed to other users (pyenv under
   /root), a private mount namespace shows only the interpreter folders there; then, switch to the per-run uid/gid the parent chose (RLIMIT_NPROC does not bind
   root, and a distinct uid lets the parent find and kill every process the run started);
4. Landlock (Linux >= 5.13): writes only below the working directory; TCP bind/connect denied;
   signals and abstract unix sockets scoped to the sandbox (it cannot signal the trainer);
5. last resort: when neither a namespace nor Landlock blocks the network, socket creation in the
   interpreter is disabled.
"""

import ctypes
import json
import os
import resource
import runpy
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1

# filesystem rights that change something (reads and execution stay allowed everywhere)
FS_WRITE_FILE = 1 << 1
FS_WRITE_RIGHTS = {
    1: FS_WRITE_FILE | sum(1 << b for b in (4, 5, 6, 7, 8, 9, 10, 11, 12)),
    2: 1 << 13,  # REFER
    3: 1 << 14,  # TRUNCATE
}
NET_BIND_CONNECT_TCP = 0b11  # ABI 4
SCOPE_ABSTRACT_UNIX_AND_SIGNAL = 0b11  # ABI 6

libc = ctypes.CDLL(None, use_errno=True)


class RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def isolate_network(uid: int, gid: int) -> str:
    if os.geteuid() == 0:
        return "netns" if libc.unshare(CLONE_NEWNET) == 0 else ""
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return ""
    # map our own ids into the new user namespace so files keep their owners
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "userns+netns"


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def expose_hidden(pairs: list[list[str]]) -> str:
    """Root only: in a private mount namespace, replace each closed folder (e.g. /root, mode 700)
    by an empty tmpfs and bind the interpreter folders inside it back, read-only, so the per-run
    uid can run Python while the rest of the closed folder stays out of sight."""
    if not pairs:
        return ""
    if libc.unshare(CLONE_NEWNS) != 0:
        return ""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    keep = {inner: os.open(inner, os.O_PATH) for _, inner in pairs}
    for closed in sorted({closed for closed, _ in pairs}):
        _mount("tmpfs", closed, "tmpfs", 0, "mode=0755,size=1m")
    for inner, fd in keep.items():
        os.makedirs(inner, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", inner, None, MS_BIND | MS_REC, None)
        _mount(None, inner, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        os.close(fd)
    return "mountns"


def set_limits(spec: dict) -> None:
    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (spec["cpu_s"], spec["cpu_s"] + 1),
        resource.RLIMIT_AS: (spec["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (spec["file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (spec["max_procs"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)


def drop_privileges(uid: int, gid: int) -> str:
    if os.geteuid() != 0:
        return ""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    return f"uid={uid}"


def landlock(workdir: str) -> tuple[str, bool]:
    """Restrict writes to ``workdir`` (and /dev/null); returns (label, network_blocked)."""
    abi = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    if abi < 1:
        return "", False
    fs = sum(rights for level, rights in FS_WRITE_RIGHTS.items() if abi >= level)
    attr = RulesetAttr(
        fs,
        NET_BIND_CONNECT_TCP if abi >= 4 else 0,
        SCOPE_ABSTRACT_UNIX_AND_SIGNAL if abi >= 6 else 0,
    )
    size = ctypes.sizeof(RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0
    )
    if ruleset < 0:
        return "", False
    for path, rights in ((workdir, fs), ("/dev/null", FS_WRITE_FILE)):
        fd = os.open(path, os.O_PATH)
        rule = PathBeneathAttr(rights, fd)
        libc.syscall(
            SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
        )
        os.close(fd)
    if (
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0
    ):
        return "", False
    os.close(ruleset)
    return f"landlock-v{abi}", abi >= 4


def disable_sockets() -> None:
    import _socket
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access is disabled in the sandbox")

    for module in (socket, _socket):
        for name in ("socket", "socketpair", "create_connection", "fromfd"):
            if hasattr(module, name):
                setattr(module, name, refuse)


def main() -> None:
    spec = json.loads(sys.argv[1])
    workdir = spec["workdir"]
    applied = [isolate_network(spec["uid"], spec["gid"])]
    applied.append(expose_hidden(spec["expose"]))
    set_limits(spec)
    applied.append("rlimits")
    applied.append(drop_privileges(spec["uid"], spec["gid"]))
    label, net_blocked = landlock(workdir)
    applied.append(label)
    if not applied[0] and not net_blocked:
        disable_sockets()
        applied.append("sockets-disabled")
    sys.stderr.write("grpo-sandbox: " + ",".join(a for a in applied if a) + "\n")
    sys.stderr.flush()
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    sys.argv = ["main.py"]
    runpy.run_path(os.path.join(workdir, "main.py"), run_name="__main__")


main()
