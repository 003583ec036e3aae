"""Math accuracy: answer extraction, cheap exact/numeric checks, and math-verify equivalence in
worker processes with a hard time limit.

Extraction strategies (tried in the configured order, the first that finds an answer wins):
``answer`` (last <answer>...</answer>), ``boxed`` (last \\boxed{...}), ``hashes`` (GSM8K's
"#### N"), and ``last_number`` (the last number in the text; off by default, it rewards
guessing). Equivalence: normalised string equality, then plain numbers (thousands separators,
currency signs, percent signs and trailing unit words removed), then math-verify (fractions,
LaTeX, sets, intervals, symbolic equality) in a worker process. A check that overruns is killed
with its worker and raises ``TimeoutError``: the runner gives the fallback and counts it.
"""

from __future__ import annotations

import json
import queue
import re
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from grpo.rewards.registry import RewardError, RewardFn, register

WORKER = Path(__file__).with_name("_math_worker.py")
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
HASHES_RE = re.compile(r"####\s*([^\n]+)")
SENTENCE_RE = re.compile(r"\banswer\s*(?:is|:|=)\s*([^\n]+)", re.IGNORECASE)
SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
PLAIN_NUMBER_RE = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?$")
UNIT_SUFFIX_RE = re.compile(r"^(-?[\d.,/]+)\s*(?:[A-Za-z][A-Za-z. ]*)?$")
# \\! \\, and "\\ " spacing commands, but not the "\\\\" row break before a space or comma
SPACING_RE = re.compile(r"(?<!\\)\\[!, ]")
LATEX_THOUSANDS_RE = re.compile(r"(?<=\d),\\!\s*(?=\d{3})|(?<=\d)\{,\}(?=\d{3})")
ANSWER_LHS_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*")  # "x = ", "a_1 = "
BASE_NUMERAL_RE = re.compile(r"^(?=[0-9A-Za-z]*\d)([0-9A-Za-z]+)_\{?(\d+)\}?$")  # 52_8, 4210_{5}
# words after a number that change its value: not units to drop
VALUE_WORDS = frozenset(
    {
        "hundred",
        "hundreds",
        "thousand",
        "thousands",
        "million",
        "millions",
        "billion",
        "billions",
        "trillion",
        "trillions",
        "dozen",
        "dozens",
        "k",
        "half",
        "halves",
        "quarter",
        "quarters",
        "third",
        "thirds",
        "fourth",
        "fourths",
        "fifth",
        "fifths",
        "tenth",
        "tenths",
        "hundredth",
        "hundredths",
        "thousandth",
        "thousandths",
        "squared",
        "cubed",
        "and",
        "times",
        "plus",
        "minus",
    }
)
MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; never hand them to SymPy


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin : i - 1] if depth == 0 else None


def _last_answer_tag(text: str) -> str | None:
    found = ANSWER_RE.findall(text)
    return found[-1] if found else None


def _after_hashes(text: str) -> str | None:
    found = HASHES_RE.findall(text)
    return found[-1] if found else None


def _final_sentence(text: str) -> str | None:
    """What follows the last "answer is" / "answer:" on its line, up to the sentence's end."""
    found = SENTENCE_RE.findall(text)
    if not found:
        return None
    return SENTENCE_END_RE.split(found[-1], maxsplit=1)[0].strip().strip("*").strip()


def _last_number(text: str) -> str | None:
    found = NUMBER_RE.findall(text)
    return found[-1] if found else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer": _last_answer_tag,
    "boxed": _last_boxed,
    "hashes": _after_hashes,
    "sentence": _final_sentence,
    "last_number": _last_number,
}


DEFAULT_EXTRACT = ("answer", "boxed", "hashes", "sentence")


def extract_answer(text: str, strategies: tuple[str, ...] = DEFAULT_EXTRACT) -> str | None:
    """The answer in a completion by the first strategy that finds one, stripped; or None."""
    for name in strategies:
        found = EXTRACTORS[name](text)
        if found is not None and found.strip():
            inner = _last_boxed(found) if name == "answer" else None  # <answer>\boxed{5}</answer>
            return (inner if inner is not None else found).strip()
    return None


def normalise(text: str) -> str:
    """Surface clean-up shared by both sides: math delimiters, \\$, LaTeX spacing commands,
    LaTeX thousands separators (``10,\\!080``, ``10{,}080`` -> ``10,080``), a final period."""
    text = text.strip().strip("$").strip()
    for wrapper in ("\\(", "\\)", "\\[", "\\]"):
        text = text.replace(wrapper, "")
    text = LATEX_THOUSANDS_RE.sub(",", text).replace("\\$", "")
    text = SPACING_RE.sub(lambda found: " " if found.group() == "\\ " else "", text)
    return text.strip().rstrip(".").strip()


def _scaled(text: str) -> bool:
    """A number followed by a word that changes its value (18 thousand, 2 and a half)."""
    text = text.replace("$", "").strip()
    unit = UNIT_SUFFIX_RE.match(text)
    words = re.findall(r"[A-Za-z]+", text[unit.end(1) :]) if unit else []
    return any(word.lower() in VALUE_WORDS for word in words)


def as_number(text: str) -> Fraction | None:
    """A plain number (1,000 / -3.5 / 3/4 / 50% / $18 / 7 apples), exactly; else None. A word
    that changes the value (18 thousand, 3 dozen, 2 and a half, 5 squared) makes it no number."""
    text = text.replace("$", "").replace("\\%", "%").rstrip("%").strip()
    unit = UNIT_SUFFIX_RE.match(text)
    if unit:
        if _scaled(text):
            return None
        text = unit.group(1).rstrip(".")
    if THOUSANDS_RE.match(text):
        text = text.replace(",", "")
    if not PLAIN_NUMBER_RE.match(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _is_percent(text: str) -> bool:
    return text.endswith("%")  # normalised text: stripped; "50\\%" ends with "%" too


def _numbers_match(pred: str, ref: str, pred_num: Fraction, ref_num: Fraction) -> bool:
    """Equal, or equal once a percentage is read as a fraction (50% = 0.5; 50% = 50 too)."""
    if pred_num == ref_num:
        return True
    return (_is_percent(pred) and pred_num / 100 == ref_num) or (
        _is_percent(ref) and ref_num / 100 == pred_num
    )


class MathVerifier:
    """A small pool of math-verify worker processes with a hard per-check time limit.

    Workers start on first use (importing SymPy takes about a second, not counted against a
    check) and are killed and replaced when a check overruns.
    """

    def __init__(
        self, processes: int = 2, timeout_s: float = 5.0, startup_s: float = 120.0
    ) -> None:
        self.processes = processes
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._idle: queue.Queue[subprocess.Popen] = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-B", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._read(proc, self.startup_s) != "ready":
            proc.kill()
            proc.wait()
            raise RuntimeError("math-verify worker did not start")
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> Any:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"math check exceeded {timeout_s:.1f} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("math-verify worker died")
        return json.loads(line)

    def _take(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise RuntimeError("math verifier is closed")
            spawn = self._idle.empty() and self._started < self.processes
            if spawn:
                self._started += 1
        if not spawn:
            return self._idle.get()
        try:
            return self._spawn()
        except BaseException:
            with self._lock:
                self._started -= 1
            raise

    def _retire(self, proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        with self._lock:
            self._started -= 1

    def equivalent(self, gold: str, prediction: str) -> bool:
        """math-verify equivalence; TimeoutError when the check overruns (its worker is killed)."""
        proc = self._take()
        try:
            proc.stdin.write(json.dumps([gold, prediction]) + "\n")
            proc.stdin.flush()
            verdict = self._read(proc, self.timeout_s)
        except BaseException:
            self._retire(proc)
            raise
        self._idle.put(proc)
        return bool(verdict)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        while not self._idle.empty():
            self._retire(self._idle.get())


def _as_latex(text: str) -> str:
    # same wrapping as the worker: math-verify extracts from \\boxed{} without $ delimiters
    return text if "\\boxed" in text else "\\boxed{" + text + "}"


def equivalent_in_process(gold: str, prediction: str, timeout_s: int = 5) -> bool:
    """math-verify in this process: its signal-based time limits hold on the main thread only,
    so elsewhere the check is unbounded (the reward runner uses ``MathVerifier`` instead)."""
    from math_verify import parse, verify

    on_main = threading.current_thread() is threading.main_thread()
    limit = timeout_s if on_main else None
    gold_parsed = parse(_as_latex(gold), parsing_timeout=limit)
    pred_parsed = parse(_as_latex(prediction), parsing_timeout=limit)
    return bool(
        gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=limit)
    )


Equivalence = Callable[[str, str], bool]


def answers_match(
    prediction: str, gold: str, equivalent: Equivalence | None = equivalent_in_process
) -> bool:
    """Exact after normalisation, equal as plain numbers (or as numerals in a base: ``52_8``), or
    ``equivalent(gold, prediction)`` (math-verify; None = no symbolic check)."""
    pred, ref = normalise(prediction), normalise(gold)
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return False
    if "=" not in ref:
        pred = ANSWER_LHS_RE.sub("", pred, count=1)  # "x = 5" answers "5"
    if pred == ref:
        return True
    pred_base, ref_base = BASE_NUMERAL_RE.match(pred), BASE_NUMERAL_RE.match(ref)
    if pred_base or ref_base:  # math-verify drops the base: 52_9 would equal 52_8
        return bool(pred_base and ref_base) and (
            pred_base[1].lower(),
            int(pred_base[2]),
        ) == (ref_base[1].lower(), int(ref_base[2]))
    if _scaled(pred) and not _scaled(ref):
        return False  # "18 thousand" is not 18, whatever math-verify makes of it
    pred_num, ref_num = as_number(pred), as_number(ref)
    if pred_num is not None and ref_num is not None:
        return _numbers_match(pred, ref, pred_num, ref_num)
    return equivalent is not None and equivalent(ref, pred)


class AccuracyReward:
    """1 when the extracted answer matches the row's gold answer, else 0; None without gold."""

    def __init__(
        self,
        answer_field: str = "answer",
        extract: list[str] | tuple[str, ...] = DEFAULT_EXTRACT,
        last_number: bool = False,
        math_verify: bool = True,
        timeout_s: float = 5.0,
        processes: int = 2,
    ) -> None:
        unknown = [name for name in extract if name not in EXTRACTORS]
        if unknown:
            raise RewardError(
                f"reward 'accuracy': unknown extract {unknown} (known: {', '.join(EXTRACTORS)})"
            )
        self.answer_field = answer_field
        self.columns = (answer_field,)  # without it every score is None (RewardRunner checks)
        self.strategies = tuple(extract) + (
            ("last_number",) if last_number and "last_number" not in extract else ()
        )
        self.verifier = MathVerifier(processes, timeout_s) if math_verify else None

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        golds = columns.get(self.answer_field) or [None] * len(completions)
        out: list[float | None] = []
        for completion, gold in zip(completions, golds, strict=True):
            if gold is None or str(gold).strip() == "":
                out.append(None)
                continue
            predicted = extract_answer(completion, self.strategies)
            check = None if self.verifier is None else self.verifier.equivalent
            out.append(float(predicted is not None and answers_match(predicted, str(gold), check)))
        return out

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()


@register("accuracy", kind="accuracy")
def accuracy_reward(**args: Any) -> RewardFn:
    """See ``AccuracyReward`` for the arguments."""
    return AccuracyReward(**args)
