"""The math verifier on real data: every GSM8K and MATH-500 gold answer, written as a model would
write it, must score 1 through the ``accuracy`` reward, and a wrong variant of it 0.

    python -m benchmarks.quality.verifiers [--sets gsm8k_test gsm8k_train math500] [--limit N]

prints the counts and every miss, and writes ``benchmarks/results/verifiers.json``.
``tests/rewards/test_verifiers_real_data.py`` runs the same checks (a seeded sample in ``make test``, all
rows in ``make test-slow``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.data.tasks import gsm8k_rows, math500_rows
from grpo.rewards.accuracy import AccuracyReward

RESULTS = Path(__file__).resolve().parents[1] / "results" / "verifiers.json"
INTEGER_RE = re.compile(r"\d+")


def _thousands(gold: str) -> str:
    """18000 -> 18,000 (as GSM8K's own solutions write large numbers)."""
    whole, dot, frac = gold.partition(".")
    sign = "-" if whole.startswith("-") else ""
    return f"{sign}{int(whole.lstrip('-')):,}{dot}{frac}"


def gsm8k_written(gold: str) -> dict[str, str]:
    """A GSM8K gold number as a model would give it: tags, box, final sentence, '####'."""
    out = {
        "answer": f"<think>Add them up.</think>\n<answer>{gold}</answer>",
        "boxed": f"Adding them up gives $\\boxed{{{gold}}}$.",
        "sentence": f"First we add the two amounts.\nThe answer is {gold}.",
        "hashes": f"Add them.\n#### {gold}",
    }
    out["sentence_unit"] = f"She pays {gold} dollars in all. The answer is {gold} dollars."
    if abs(float(gold)) >= 1000:
        out["answer_thousands"] = f"<answer>{_thousands(gold)}</answer>"
        out["sentence_thousands"] = f"So the final answer is {_thousands(gold)}."
    return out


def math_written(gold: str) -> dict[str, str]:
    """A MATH gold answer (LaTeX) as a model would give it, plus the spellings models use that
    the gold's typesetting does not: no thin spaces in numbers, no spaces at all."""
    out = {
        "answer": f"<think>Work it out.</think>\n<answer>{gold}</answer>",
        "boxed": f"Putting it together, the answer is $\\boxed{{{gold}}}$.",
        "sentence": f"Putting it together.\nThe final answer is ${gold}$.",
    }
    plain = re.sub(r",\\!\s*|\{,\}", "", gold)
    if plain != gold:
        out["no_thousands"] = f"<answer>{plain}</answer>"
    for style, spelled in (
        ("frac", gold.replace("\\dfrac", "\\frac")),
        ("no_degrees", re.sub(r"\^\s*\{?\\circ\}?", "", gold)),
        ("no_unit", re.sub(r"\s*\\(?:text|mbox)\{\s*[a-z ]+\}(?:\^\d)?$", "", gold)),
    ):
        if spelled != gold and spelled.strip():
            out[style] = f"<answer>{spelled}</answer>"
    compact = re.sub(r"\s+", "", gold)
    if compact != gold and "\\text" not in gold:
        out["compact"] = f"\\boxed{{{compact}}}"
    return out


def scaled(gold: str) -> list[str]:
    """The gold number with a word that changes its value: each must score 0."""
    return [
        f"The answer is {gold} thousand.",
        f"<answer>{gold} hundred</answer>",
        f"<answer>{gold}k</answer>",
        f"<answer>{gold} and a half</answer>",
    ]


def wrong(gold: str) -> str:
    """A wrong answer of the same shape: every integer in the gold plus one (else gold + 1)."""
    if INTEGER_RE.search(gold) is None:
        return f"{gold}+1"
    return INTEGER_RE.sub(lambda found: str(int(found.group()) + 1), gold)


Writer = Callable[[str], dict[str, str]]
SETS: dict[str, tuple[Callable[[], list[dict[str, Any]]], Writer, Callable[[str], list[str]]]] = {
    "gsm8k_test": (lambda: gsm8k_rows("test"), gsm8k_written, scaled),
    "gsm8k_train": (lambda: gsm8k_rows("train"), gsm8k_written, scaled),
    "math500": (math500_rows, math_written, lambda gold: []),
}


def check(
    golds: list[str],
    written: Writer,
    false_friends: Callable[[str], list[str]],
    reward: AccuracyReward,
) -> dict[str, Any]:
    """Score every gold written every way (must be 1), its wrong variant the same ways and its
    false friends (0)."""
    texts, answers, expected, labels = [], [], [], []
    for gold in golds:
        bad = written(wrong(gold))
        for style, text in written(gold).items():
            texts.append(text)
            labels.append((gold, style, "right"))
            expected.append(1.0)
            if style in bad:
                texts.append(bad[style])
                labels.append((gold, style, "wrong"))
                expected.append(0.0)
        for text in false_friends(gold):
            texts.append(text)
            labels.append((gold, "scaled", "wrong"))
            expected.append(0.0)
        answers += [gold] * (len(texts) - len(answers))
    scores = reward(texts, answer=answers)
    misses = [
        {"gold": gold, "style": style, "variant": kind, "text": text, "score": score}
        for (gold, style, kind), text, score, want in zip(
            labels, texts, scores, expected, strict=True
        )
        if score != want
    ]
    right = sum(1 for want in expected if want == 1.0)
    return {
        "golds": len(golds),
        "right_written": right,
        "right_scored_1": right - sum(1 for m in misses if m["variant"] == "right"),
        "wrong_written": len(expected) - right,
        "wrong_scored_0": len(expected) - right - sum(1 for m in misses if m["variant"] == "wrong"),
        "misses": misses,
    }


def golds_of(name: str) -> list[str]:
    rows = SETS[name][0]
    return [row["answer"] for row in rows() if row["answer"] is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--limit", type=int, default=None, help="first N golds of each set")
    args = parser.parse_args()
    reward = AccuracyReward(processes=2)
    out: dict[str, Any] = {}
    try:
        for name in args.sets:
            golds = golds_of(name)[: args.limit]
            out[name] = result = check(golds, *SETS[name][1:], reward)
            print(
                f"{name}: {result['golds']} golds; right answers scored 1: "
                f"{result['right_scored_1']}/{result['right_written']}; wrong answers scored 0: "
                f"{result['wrong_scored_0']}/{result['wrong_written']}"
            )
            for miss in result["misses"]:
                print(f"  miss ({miss['style']}, {miss['variant']}): gold {miss['gold']!r}")
    finally:
        reward.close()
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
