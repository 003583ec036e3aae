"""User reward worker: runs as a script in a child process that the reward runner can kill.

Standard library only, so a worker starts in a fraction of a second (the trainer's package pulls
in torch). The parent also imports this module for ``load_function`` and ``check_values``, so the
in-process and worker paths judge a return value the same way.

Protocol over two inherited pipe fds (``multiprocessing.connection`` framing, pickled messages):
parent -> worker ``{"refs": [...], "args": [...], "sys_path": [...]}`` (``args[j]`` a dict:
``refs[j]`` is a factory, called with it), then ``(k, completions, kwargs)`` per
call; worker -> parent ``("ready", [each function's batched flag])`` or ``("import_error", line)``, then per call one of
``("ok", values)``, ``("bad", line)`` (a malformed return value), ``("raised", traceback)``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def load_function(ref: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function``; ValueError with one line if not."""
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"file {path} not found")
        spec = importlib.util.spec_from_file_location(f"grpo_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # user code: any failure is reported in one line
            raise ValueError(f"importing {path} failed: {err!r}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ValueError(f"cannot import module '{target}' ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"'{attr}' is not a function in {target}")
    return fn


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


FLOAT32_MAX = 3.4028234663852886e38


def check_values(name: str, values: Any, expected: int) -> list[float | None]:
    """The function's return value as floats (None kept), or ValueError naming the function."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # numpy arrays and tensors, as TRL accepts them
    if not isinstance(values, (list, tuple)):
        raise ValueError(
            f"reward '{name}' returned a {_describe(values)}; expected a list of {expected} "
            "numbers (or None), one per completion"
        )
    if len(values) != expected:
        raise ValueError(
            f"reward '{name}' returned {len(values)} values for {expected} completions"
        )
    out: list[float | None] = []
    for i, value in enumerate(values):
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            with contextlib.suppress(ValueError, TypeError, RuntimeError):  # not one number
                value = value.item()  # a numpy scalar (np.bool_ too) or a 0-d tensor
        if value is not None and (isinstance(value, str) or not isinstance(value, numbers.Real)):
            raise ValueError(
                f"reward '{name}' returned a {_describe(value)} at position {i}; "
                "expected a number or None"
            )
        if value is None:
            out.append(None)
            continue
        try:
            number = float(value)  # an int past float's range raises OverflowError
        except OverflowError:
            number = math.inf
        # scores are float32: beyond its range a value would become inf there
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            raise ValueError(
                f"reward '{name}' returned {number:.3g} at position {i}; expected a finite "
                f"number within float32's range (+-{FLOAT32_MAX:.3g})"
            )
        out.append(number)
    return out


def _names_completions(fn: Any) -> bool:
    """Whether ``fn`` has a parameter called ``completions`` (then it gets them by keyword)."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False


def _exit_with_parent(parent: int) -> None:
    # a call stuck in user code never reads EOF, so watch the parent instead
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(read_fd: int, write_fd: int, parent: int) -> None:
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    init = inbox.recv()
    sys.path[:] = init["sys_path"]
    refs = init["refs"]
    arglists = init.get("args") or [None] * len(refs)
    functions = []
    for ref, args in zip(refs, arglists, strict=True):
        try:
            fn = load_function(ref)
            functions.append(fn if args is None else fn(**args))
        except ValueError as err:
            outbox.send(("import_error", f"reward '{ref}': {err}"))
            return
    outbox.send(("ready", [bool(getattr(fn, "batched", False)) for fn in functions]))
    # a factory's function is named as its reward (``reasoning_gym``), a user function by its ref
    names = [
        ref.rpartition(":")[2] if args is None else fn.__name__
        for ref, args, fn in zip(refs, arglists, functions, strict=True)
    ]
    by_name = [_names_completions(fn) for fn in functions]
    while True:
        try:
            k, completions, kwargs = inbox.recv()
        except EOFError:  # the runner closed: done
            return
        try:
            if by_name[k]:  # by keyword, as TRL calls rewards: f(prompts, completions, **kw)
                values = functions[k](completions=completions, **kwargs)
            else:  # f(texts, **kw): the completions are its first argument
                values = functions[k](completions, **kwargs)
        except BaseException as err:  # user code: whatever it raises (SystemExit too) is reported
            frames = err.__traceback__.tb_next  # from the user's function down, not this loop
            outbox.send(("raised", "".join(traceback.format_exception(type(err), err, frames))))
            continue
        try:
            outbox.send(("ok", check_values(names[k], values, len(completions))))
        except ValueError as err:
            outbox.send(("bad", str(err)))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
