"""User code named in a config: ``path/to/file.py:NAME`` or ``module:NAME``, loaded in this
process (environment classes, verifiers tasksets), every failure one line."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def error_line(err: BaseException) -> str:
    """An exception as one line: ``ValueError: bad guess``."""
    said = str(err).strip().splitlines()
    return f"{type(err).__name__}: {said[0]}" if said else type(err).__name__


def one_line(err: BaseException) -> str:
    """An exception's whole message as one short line, ``ConnectionError: ...``: torch's errors
    may carry a C++ stack after their message, which is cut."""
    said = str(err).split("Exception raised from", 1)[0]
    return f"{type(err).__name__}: {' '.join(said.split())[:300]}"


def load_named(spec: str, kind: str = "NAME") -> Any:
    """What ``spec`` names; ``ValueError`` with one line (no traceback) when it cannot be had.
    ``kind`` names what is expected in the messages (``ClassName``)."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"expected path/to/file.py:{kind} or module:{kind}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"file {path} not found")
        module_spec = importlib.util.spec_from_file_location(f"grpo_user_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        # registered as an import would be: a dataclass, or a class whose annotations are
        # strings (``from __future__ import annotations``), looks its module up there
        sys.modules[module_spec.name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # user code: any failure is one line
            del sys.modules[module_spec.name]
            raise ValueError(f"importing {path} failed ({error_line(err)})") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:  # an ImportError, or the module's own code failing
            raise ValueError(f"cannot import {target} ({error_line(err)})") from None
    if not hasattr(module, name):
        raise ValueError(f"{target} has no {'class ' if kind == 'ClassName' else ''}{name}")
    return getattr(module, name)
