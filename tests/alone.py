"""A grpo module of the standard library only, loaded on its own in a child process: ``import
grpo`` imports the trainer (torch and transformers, seconds of start-up), which a child that
needs one such module would pay for nothing."""

from __future__ import annotations

from types import ModuleType


def preamble(module: ModuleType) -> str:
    """Source that loads ``module`` from its file under its own name, without its packages: a
    later ``from grpo.x import y`` in the child finds it loaded. A grpo import added to the
    module fails the child loudly."""
    return (
        "import importlib.util as _util, sys as _sys\n"
        f"_spec = _util.spec_from_file_location({module.__name__!r}, {module.__file__!r})\n"
        "_module = _sys.modules[_spec.name] = _util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_module)\n"
    )
