"""Sandbox bootstrap: the first code of every sandboxed process (stdlib only, never imported by
the trainer).

The trainer starts it once as a *fork server* (``python -I -B _boot.py SOCKET_FD``) that
has already imported everything a run needs; each run costs a fork, not an interpreter start.
For each request (a datagram naming the file descriptors it carries: the run's control socket,
stdout, stderr and the call pipes), the server forks a *keeper* and forgets it. The keeper reads
the spec as JSON on the control socket, reports its pid and its first process's pid there, waits
for the trainer's go, and at the end reports the exit status.

The keeper joins the run's cgroups and unshares fresh namespaces: PID, mount,
network (no interface up), IPC (SysV objects and POSIX message queues die with it) and UTS; without
root it first enters a new user namespace, which grants those. It then forks the run's first
process, PID 1 of the new PID namespace: when PID 1 exits, the kernel kills every process left in
the namespace, and PID 1 itself dies with the keeper (``PR_SET_PDEATHSIG``). The keeper only waits
and exits with PID 1's status.

PID 1, before any untrusted code:
1. mounts: propagation made private; empty tmpfs over the folders it must not read (the trainer's
   home and working directory, ``/tmp``, ``/var/tmp``, and as root the closed folders holding the
   interpreter) with the interpreter's folders bound back; a size-capped private ``/tmp`` (its
   working directory) and ``/dev/shm``; a ``/proc`` of its own PID namespace;
2. stdin: the spec's text in a memfd (nothing to block on);
3. rlimits: CPU seconds, address space, file size (memfds included), process count, open files,
   no core files;
4. privileges: as root, the per-run uid/gid the trainer chose; otherwise every capability of the
   user namespace dropped;
5. Landlock (Linux >= 5.13, best effort by ABI): writes only below ``/tmp`` and ``/dev/shm``; TCP
   bind/connect denied; signals and abstract unix sockets scoped to the sandbox;
then forks the program (PID 2; PID 1 stays as a minimal init, see ``init``), which runs its
role: ``script`` (``main.py`` as ``__main__``), ``candidate`` (the program, then answering calls
from the judge) or ``judge`` (the test code, against proxies of the candidate).
"""

import ctypes
import json
import os
import resource
import signal
import socket
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522

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

WORKDIR = "/tmp"
MAIN = "/tmp/main.py"

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


def _check(ret: int, what: str) -> None:
    if ret != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source, target: str, fstype, flags: int, data) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def unshare_namespaces(spec: dict) -> list[str]:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if spec["uid"] is not None:  # root: the namespaces need no user namespace
        _check(libc.unshare(flags), "unshare")
        return ["pidns", "mountns", "netns", "ipcns"]
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | flags), "unshare")
    # map our own ids, so files keep their owners; the new namespace grants the capabilities to
    # mount and is dropped again before any untrusted code
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return ["userns", "pidns", "mountns", "netns", "ipcns"]


def set_up_mounts(spec: dict) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    owner = "" if spec["uid"] is None else f",uid={spec['uid']},gid={spec['gid']}"
    options = {mask: "mode=0755,size=1m" for mask in spec["masks"]}
    options[WORKDIR] = f"mode=0700,size={spec['memory_mb']}m{owner}"
    options["/dev/shm"] = f"mode=1777,size={spec['file_mb']}m"
    keep = {root: os.open(root, os.O_PATH) for root in spec["roots"] if os.path.isdir(root)}
    for target in sorted(options, key=len):  # parents first
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options[target])
    for root, fd in keep.items():
        if any(root.startswith(target.rstrip("/") + "/") for target in options):
            os.makedirs(root, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", root, None, MS_BIND | MS_REC, None)
        os.close(fd)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def stdin_from(text: str) -> None:
    fd = os.memfd_create("stdin")
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)


def set_limits(spec: dict) -> None:
    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (spec["cpu_s"], spec["cpu_s"] + 1),
        resource.RLIMIT_AS: (spec["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (spec["file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (spec["max_procs"],) * 2,
        resource.RLIMIT_NOFILE: (spec["max_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)


class CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def drop_privileges(spec: dict) -> str:
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
        return f"uid={spec['uid']}"
    header, data = CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")
    return "no-caps"


def landlock() -> str:
    abi = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    if abi < 1:
        return ""
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
        return ""
    for path, rights in ((WORKDIR, fs), ("/dev/shm", fs), ("/dev/null", FS_WRITE_FILE)):
        fd = os.open(path, os.O_PATH)
        rule = PathBeneathAttr(rights, fd)
        libc.syscall(
            SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
        )
        os.close(fd)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock")
    os.close(ruleset)
    return f"landlock-v{abi}"


def first_process(
    spec: dict, ctl: socket.socket, go: int, status: int, isolation: list[str]
) -> None:
    """PID 1 of the run: finish the isolation, report it, run the role."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if os.read(go, 1) != b"g":  # the keeper died before we could watch it
        os._exit(1)
    os.close(go)
    for procs in spec["cgroup_procs"]:  # the keeper stays outside: it must outlive a cgroup kill
        with open(procs, "w") as f:
            f.write("0")
    set_up_mounts(spec)
    with open(MAIN, "w") as f:
        f.write(spec["source"])
    if spec["uid"] is not None:
        os.chown(MAIN, spec["uid"], spec["gid"])
    stdin_from(spec["stdin"])
    set_limits(spec)
    isolation += ["cgroup" if spec["cgroup_procs"] else "rlimit-memory", "rlimits"]
    isolation.append(drop_privileges(spec))
    isolation.append(landlock())
    ctl.sendall(json.dumps({"isolation": [x for x in isolation if x]}).encode() + b"\n")
    ctl.close()
    os.chdir(WORKDIR)
    os.environ.clear()
    os.environ.update(spec["env"])
    program = os.fork()
    if program == 0:  # PID 2
        os.close(status)
        _wire.ROLES[spec["role"]](spec, MAIN)
        return
    init(program, status)


def init(program: int, status: int) -> None:
    """PID 1 ignores every signal it has no handler for (RLIMIT_CPU's SIGXCPU, a SIGTERM the
    program sends itself) and inherits every orphan: so the program runs as PID 2 and this
    minimal init reaps, then passes the program's wait status to the keeper and exits, which
    makes the kernel kill whatever is left in the namespace."""
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace from the program (same uid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.closerange(0, status)  # the run's pipes: only the program holds them
    os.closerange(status + 1, 1 << 16)
    while True:
        pid, wait_status = os.waitpid(-1, 0)
        if pid == program:
            os.write(status, wait_status.to_bytes(4, "little"))
            os._exit(0)


def _read_spec(ctl: socket.socket) -> dict:
    size = int.from_bytes(ctl.recv(8, socket.MSG_WAITALL), "big")
    return json.loads(ctl.recv(size, socket.MSG_WAITALL))


def keeper(fds: dict[str, int]) -> None:
    """One run: namespaces, PID 1, then wait for it and report its exit status."""
    ctl = socket.socket(fileno=fds.pop("ctl"))
    spec = _read_spec(ctl)
    spec.update(fds)
    try:
        isolation = unshare_namespaces(spec)
    except OSError as err:
        reason = err.strerror or str(err)  # "unshare: No space left on device"
        ctl.sendall(json.dumps({"error": reason}).encode() + b"\n")
        os._exit(2)
    go_read, go_write = os.pipe()
    status_read, status_write = os.pipe()  # PID 1 -> keeper: the program's wait status
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        code = 0
        try:
            first_process(spec, ctl, go_read, status_write, isolation)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)  # as Python says sys.exit("message")
        except BaseException:
            traceback.print_exc()
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                code = code or 120  # what Python returns when it cannot flush at exit
        os._exit(code)
    os.close(go_read)
    ctl.sendall(json.dumps({"keeper": os.getpid(), "pid": pid}).encode() + b"\n")
    if ctl.recv(1) == b"g":  # the trainer holds a pidfd of PID 1 now
        os.write(go_write, b"g")
    os.close(go_write)
    # the keeper holds nothing else of the run: its output and pipes belong to PID 1
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2, *fds.values()):
        os.dup2(devnull, fd)
    os.close(status_write)
    _, status = os.waitpid(pid, 0)
    program_status = os.read(status_read, 4)
    if len(program_status) == 4:
        status = int.from_bytes(program_status, "little")
    ctl.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    os._exit(0)


def server(sock: socket.socket) -> None:
    """Fork a keeper per request until the trainer closes the socket."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    while True:
        try:
            names, fds, _, _ = socket.recv_fds(sock, 4096, 16)
        except ConnectionResetError:
            return
        if not names:
            return
        if os.fork() == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            named = dict(zip(json.loads(names), fds, strict=True))
            os.dup2(named.pop("stdout"), 1)
            os.dup2(named.pop("stderr"), 2)
            try:
                keeper(named)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _wire  # loaded once, in the server, for every run it forks

    sys.path.pop(0)
    server(socket.socket(fileno=int(sys.argv[1])))
