"""Which torch functions a piece of code calls, and on how many rows (a test's probe)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class RowsOf(TorchFunctionMode):
    """Records the row count of the first argument of every call ``wanted(func)`` accepts."""

    def __init__(self, wanted: Callable[[Callable[..., Any]], bool]) -> None:
        super().__init__()
        self.wanted = wanted
        self.rows: list[int] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: object, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if self.wanted(func):
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))
