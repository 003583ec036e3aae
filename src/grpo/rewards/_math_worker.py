"""Math-verify worker: runs as a script in a child process, one check per request line.

math-verify's own time limits use ``signal.alarm`` (main thread only, ignored while SymPy runs C
code, and a timeout silently reads as "not equal"). Instead the parent bounds each check from
outside: when a check overruns, it kills this process and counts a timeout. Protocol: stdin lines
``[gold, prediction]``, stdout lines ``true`` / ``false`` / ``null`` (no verdict), after a first
``"ready"`` line.
"""

import json
import os
import sys

channel = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol

from math_verify import parse, verify  # noqa: E402


def as_latex(text: str) -> str:
    return text if "\\boxed" in text else "\\boxed{" + text + "}"


def equivalent(gold: str, prediction: str) -> bool:
    gold_parsed = parse(as_latex(gold), parsing_timeout=None)
    pred_parsed = parse(as_latex(prediction), parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


channel.write('"ready"\n')
for line in sys.stdin:
    gold, prediction = json.loads(line)
    try:
        verdict = equivalent(gold, prediction)
    except Exception:  # a SymPy failure on odd input means "no verdict", reported as such
        verdict = None
    channel.write(json.dumps(verdict) + "\n")
