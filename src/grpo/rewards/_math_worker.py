"""Math-verify worker: runs as a script in a child process, one check per request line.

math-verify bounds parsing and verification with ``signal.alarm``, which only works in a
process's main thread; here every check runs in this process's main thread, so those limits
hold, and the parent kills the whole process if a check still overruns (SymPy in C code ignores
signals). Protocol: stdin lines ``[gold, prediction, timeout_s]``, stdout lines ``true`` /
``false`` / ``null`` (no verdict), after a first ``"ready"`` line.
"""

import json
import os
import sys

channel = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol

from math_verify import parse, verify  # noqa: E402


def as_latex(text: str) -> str:
    return text if "\\boxed" in text else "\\boxed{" + text + "}"


def equivalent(gold: str, prediction: str, timeout_s: int) -> bool:
    gold_parsed = parse(as_latex(gold), parsing_timeout=timeout_s)
    pred_parsed = parse(as_latex(prediction), parsing_timeout=timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


channel.write('"ready"\n')
for line in sys.stdin:
    gold, prediction, timeout_s = json.loads(line)
    try:
        verdict = equivalent(gold, prediction, timeout_s)
    except Exception:  # a SymPy failure on odd input means "no verdict", reported as such
        verdict = None
    channel.write(json.dumps(verdict) + "\n")
