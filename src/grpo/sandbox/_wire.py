"""The roles a sandboxed process plays, and the value format between candidate and judge
(stdlib only; loaded by ``_boot.py`` inside the sandbox, never by the trainer).

- ``script``: run ``main.py`` as ``__main__`` (the tool loop, stdin/stdout tests).
- ``candidate``: run the program as module ``solution``, report its callables, then answer calls
  ``{"call": name, "args": [...], "kwargs": {...}}`` with ``{"value": v}`` or
  ``{"raised": "ValueError", "message": "..."}``, one JSON line each.
- ``judge``: run the row's test code in its own process. The names the candidate defines (and
  ``candidate`` for HumanEval's ``check(candidate)``) are proxies that send the arguments and
  return the decoded reply; one ``pass i`` / ``fail i`` line per test goes to the trainer on a
  pipe only the judge holds, then ``done``.

Values cross as JSON with tags for what JSON lacks (tuple, dict with any keys, set, frozenset,
bytes, complex, non-finite floats). Decoding builds only builtin containers and scalars, so no
object the candidate made, and no method it wrote, ever reaches the judge.
"""

import builtins
import json
import math
import os
import runpy
import sys
import traceback

MAX_DEPTH = 100
MAX_REPLY_BYTES = 64 << 20
TAGS = {
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
}
# builtin types whose subclasses (and numpy-like scalars) are sent as their plain value
PLAIN = {bool: bool, int: int.__int__, float: float.__float__, str: str.__str__}


def encode(value, depth: int = 0):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [encode(value.real), encode(value.imag)]}
    for base, plain in PLAIN.items():
        if isinstance(value, base):
            return encode(plain(value), depth + 1)
    for base in (list, tuple, set, frozenset, dict, bytes):
        if isinstance(value, base):
            return encode(base(value), depth + 1)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return encode(value.tolist(), depth + 1)
    raise TypeError(f"cannot send a {kind.__name__} between candidate and judge")


def decode(data, depth: int = 0):
    """Plain values from ``json.loads`` output; anything unexpected raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if data is None or type(data) in (bool, int, str, float):
        return data
    if type(data) is list:
        return [decode(v, depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = data.items()
    if tag in TAGS and type(body) is list:
        return TAGS[tag](decode(v, depth + 1) for v in body)
    if tag == "dict" and type(body) is list:
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(decode(body[0], depth + 1), decode(body[1], depth + 1))
    raise ValueError(f"malformed value with tag {tag!r}")


def send(stream, message: dict) -> None:
    stream.write(json.dumps(message, allow_nan=False).encode() + b"\n")
    stream.flush()


def receive(stream) -> dict | None:
    """The next message, or None when the other side is gone or sent something malformed."""
    line = stream.readline(MAX_REPLY_BYTES)
    if not line.endswith(b"\n"):
        return None
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return message if type(message) is dict else None


def _program_traceback(exc: BaseException, path: str) -> None:
    """Print a traceback that starts at the program's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def run_script(spec: dict, path: str) -> None:
    sys.argv = [os.path.basename(path)]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        _program_traceback(exc, path)
        sys.exit(1)


def run_candidate(spec: dict, path: str) -> None:
    calls = os.fdopen(spec["calls_in"], "rb")
    replies = os.fdopen(spec["calls_out"], "wb")
    sys.path.insert(0, os.path.dirname(path))
    namespace = {"__name__": "solution", "__file__": path, "__builtins__": builtins}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), namespace)
    except BaseException as exc:  # SystemExit included: a program that stops passes nothing
        _program_traceback(exc, path)
        send(replies, {"error": f"{type(exc).__name__}: {exc}"[:1000]})
        return
    names = [n for n, v in namespace.items() if callable(v) and not n.startswith("__")]
    send(replies, {"ready": names})
    while (request := receive(calls)) is not None:
        try:
            function = namespace.get(request["call"])
            if not callable(function):
                raise NameError(f"name {request['call']!r} is not defined")
            args = decode(request["args"])
            kwargs = decode(request["kwargs"])
            reply = {"value": encode(function(*args, **kwargs))}
        except Exception as exc:
            reply = {"raised": type(exc).__name__, "message": str(exc)[:1000]}
        send(replies, reply)


class CandidateError(Exception):
    """The candidate raised something the judge does not re-raise as it is, or went away."""


def _exception(name: object, message: object) -> Exception:
    kind = getattr(builtins, name, None) if type(name) is str else None
    text = message if type(message) is str else ""
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(text)
    return CandidateError(f"{name}: {text}")


def proxy(name: str, requests, replies):
    """A stand-in for the candidate's function ``name``: arguments out, a plain value back."""

    def call(*args, **kwargs):
        try:
            send(requests, {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)})
        except OSError:
            raise CandidateError("the candidate is gone") from None
        reply = receive(replies)
        if reply is None:
            raise CandidateError("the candidate is gone or sent a malformed reply")
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, RecursionError) as err:
                raise CandidateError(f"malformed value: {err}") from None
        raise _exception(reply.get("raised"), reply.get("message"))

    call.__name__ = call.__qualname__ = name
    return call


def run_judge(spec: dict, path: str) -> None:
    task = json.loads(sys.stdin.read())
    requests = os.fdopen(spec["calls_out"], "wb")
    replies = os.fdopen(spec["calls_in"], "rb")
    verdict = spec["verdict"]
    tests, entry_point = task["tests"], task["entry_point"]
    hello = receive(replies)
    names = hello.get("ready") if hello else None
    namespace = {"__name__": "judge", "__builtins__": builtins}
    if type(names) is list:
        if task["prefix"]:  # trusted helpers from the dataset (HumanEval's prompt)
            try:
                exec(compile(task["prefix"], "prefix.py", "exec"), namespace)
            except Exception:
                traceback.print_exc()
        for name in names:
            # never a builtin: the tests' abs, range, sorted ... are Python's, not the candidate's
            if type(name) is str and name not in namespace and not hasattr(builtins, name):
                namespace[name] = proxy(name, requests, replies)
        if entry_point:
            namespace[entry_point] = proxy(entry_point, requests, replies)
    for i, test in enumerate(tests):
        passed = type(names) is list
        if passed:
            try:
                exec(compile(test, f"test_{i}.py", "exec"), namespace)
            except BaseException:
                traceback.print_exc(limit=-3)
                passed = False
        os.write(verdict, f"{'pass' if passed else 'fail'} {i}\n".encode())
    os.write(verdict, b"done\n")


ROLES = {"script": run_script, "candidate": run_candidate, "judge": run_judge}
