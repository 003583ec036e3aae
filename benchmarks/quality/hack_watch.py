"""The reward-hacking watch replayed over recorded runs: which lines it gives on each run, from
the run's ``metrics.jsonl`` (the ``hack/*`` signals, the accuracy rewards' means) and its
``completions/`` (where all of a step's completions are logged, ``train.log_completions`` >=
P x G: the template copy without ``data.few_shot``'s examples, the groups with restated answers). The numbers behind
docs/results/hack-watch.md: warnings on honest runs (target 0) and the first warning of runs
whose reward was gamed.

    .venv/bin/python -m benchmarks.quality.hack_watch --honest runs/a runs/b --gamed runs/c \\
        --gamed-json benchmarks/results/r1_zero.json [--out F]

``--gamed-json``: the per-step signals that ``benchmarks.quality.r1_zero`` recorded (runs made
before this script; no completions, and none had worked examples). For each run, ``before`` is
what the watch printed when the run was made (each ``hack/*`` metric crossing its threshold,
once per crossing), ``after`` what ``grpo.training.hack_watch`` says now over the same record.

And the user-style task of the study, unit conversions with a worked example (the files under
``benchmarks/quality/unit_conversions/``, its recipe beside them):

    .venv/bin/python -m benchmarks.quality.hack_watch task
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from benchmarks import common
from grpo.build import prompt_format
from grpo.config import Config, HackWatchConfig, RewardSpec
from grpo.config.loading import build_config, read_recipe
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.data.prompts import scored_texts
from grpo.models.aliases import resolve_model_path
from grpo.models.loading import load_tokenizer
from grpo.rewards.accuracy import extract_answer
from grpo.rewards.copying import copies, template_ngrams
from grpo.training.hack_watch import (
    Evidence,
    HackWatch,
    Said,
    answers_follow_questions,
    restates_question,
    row_texts,
    share_beyond_one_group,
)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "hack_watch.json"
TASK = Path(__file__).resolve().parent / "unit_conversions"
# (from, to, factor): each conversion's answer is a whole number
UNITS = (
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("kilograms", "grams", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("feet", "inches", 12),
    ("yards", "feet", 3),
    ("liters", "milliliters", 1000),
    ("weeks", "days", 7),
)


def unit_conversion_rows(seed: int = 0) -> list[dict[str, str]]:
    """Every conversion of 2..20 of a unit in ``UNITS`` (190 rows), shuffled."""
    rows = [
        {"prompt": f"Convert {v} {a} to {b}.", "answer": str(v * f)}
        for a, b, f in UNITS
        for v in range(2, 21)
    ]
    random.Random(seed).shuffle(rows)
    return rows


def write_task(folder: Path, held_out: int = 40) -> None:
    """``train.jsonl`` and ``test.jsonl`` (the last ``held_out`` rows) of the unit conversions."""
    rows = unit_conversion_rows()
    for name, part in (("train", rows[:-held_out]), ("test", rows[-held_out:])):
        text = "".join(json.dumps(row) + "\n" for row in part)
        (folder / f"{name}.jsonl").write_text(text)


# --------------------------------------------------------------------------- recorded runs


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's training steps in ``metrics.jsonl`` (not events, not evaluation-only rows)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r and "completion_len/mean" in r]


def rows_by_prompt(config: Config) -> dict[str, dict[str, Any]]:
    """Each training row by its rendered prompt, as the run rendered it."""
    tokenizer = load_tokenizer(resolve_model_path(config.model.name))
    fmt = prompt_format(config)
    rows = load_dataset_rows(config.data, config.train.seed)
    return {fmt.render(tokenizer, row): row for row in rows}


def evidence(
    records: list[dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    examples: list[str],
    n: int,
    group_size: int,
) -> Evidence:
    """What a step's logged completions (all of them, in rollout order) show the watch, as
    ``HackWatch.observe`` computes it from the rollout."""
    copied, restated, answers = [], [], []
    for record in records:
        row = rows[record["prompt"]]
        question = row_texts(row["prompt"])
        answer = record["turns"][-1]["text"] if "turns" in record else record["completion"]
        template = template_ngrams(record["prompt"], [*examples, *question], n)
        copied.append(copies(answer, template, n))
        (text,) = [answer] if "turns" in record else scored_texts([record["prompt"]], [answer])
        gold = row.get("answer")
        answers.append(extract_answer(text))
        restated.append(restates_question(answers[-1], " ".join(question), gold, text))
    return Evidence(
        sum(copied) / len(copied),
        share_beyond_one_group(restated, group_size),
        answers_follow_questions(answers, group_size),
    )


def crossings(steps: list[dict[str, Any]], thresholds: dict[str, float]) -> list[dict[str, Any]]:
    """What the watch printed before: a line each time a recorded ``hack/*`` metric went above
    its threshold, once per crossing."""
    raised: set[str] = set()
    lines = []
    for row in steps:
        for key, threshold in thresholds.items():
            if not row.get(key, 0.0) > threshold:
                raised.discard(key)
            elif key not in raised:
                raised.add(key)
                lines.append({"step": row["step"], "key": key})
    return lines


def replay(steps: list[dict[str, Any]], watch: HackWatch, seen: dict[int, Evidence]) -> list[Said]:
    """The lines ``watch`` gives over recorded ``steps``; ``seen``: what each step's
    completions showed, where they were logged (else the metrics alone: the copy share as
    ``hack/template_copy``, restated answers as spread as ``hack/question_restated``)."""
    lines: list[Said] = []
    for row in steps:
        values = {k: v for k, v in row.items() if k in watch.thresholds}
        unseen = Evidence(row["hack/template_copy"], row["hack/question_restated"])
        lines += watch.speak(row["step"], values, row, seen.get(row["step"], unseen))
    return lines


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(
    name: str,
    honest: bool,
    steps: list[dict[str, Any]],
    watch: HackWatch,
    seen: dict[int, Evidence],
) -> dict[str, Any]:
    lines = replay(steps, watch, seen)
    warnings = [{"step": s.step, "key": s.key, "text": s.text} for s in lines if s.warning]
    accuracy = [
        sum(row.get(f"reward/{n}/mean", 0.0) for n in watch.accuracy_names)
        / len(watch.accuracy_names)
        for row in steps
        if watch.accuracy_names
    ]
    return {
        "run": name,
        "honest": honest,
        "steps": len(steps),
        "accuracy_reward_first_5": mean(accuracy[:5]),
        "accuracy_reward_last_5": mean(accuracy[-5:]),
        "before": crossings(steps, watch.thresholds),
        "warnings": warnings,
        "notes": [{"step": s.step, "key": s.key, "text": s.text} for s in lines if not s.warning],
        "first_warning": warnings[0]["step"] if warnings else None,
        "steps_with_completions": sorted(seen),
    }


def run_dir_summary(run_dir: Path, honest: bool) -> dict[str, Any]:
    # the run wrote its paths as it used them, from its working directory: not the file's
    config = build_config(read_recipe(run_dir / "config.yaml"))
    examples = [turn.content for turn in config.data.few_shot]
    watch = HackWatch(config.train.hack_watch, config.rewards.functions, examples)
    steps = step_rows(run_dir)
    g = config.rollout.group_size
    per_step = config.rollout.prompts_per_step * g
    logged = {
        row["step"]: run_dir / "completions" / f"step-{row['step']:06d}.jsonl" for row in steps
    }
    logged = {
        step: [json.loads(x) for x in path.read_text().splitlines()]
        for step, path in logged.items()
        if path.is_file()
    }
    logged = {step: records for step, records in logged.items() if len(records) == per_step}
    rows = rows_by_prompt(config) if logged else {}
    n = config.train.hack_watch.copy_ngram
    seen = {step: evidence(r, rows, watch.examples, n, g) for step, r in logged.items()}
    out = summary(run_dir.name, honest, steps, watch, seen)
    out["source"] = str(run_dir)
    out["system_prompt"] = system_prompt_for(config.data)
    return out


def json_runs(path: Path) -> list[dict[str, Any]]:
    """The runs ``benchmarks.quality.r1_zero`` recorded (default watch settings, no examples)."""
    runs = []
    for run in json.loads(path.read_text())["runs"]:
        per_step = run["per_step"]
        steps = [
            {"step": i + 1, **{k: v[i] for k, v in per_step.items()}}
            for i in range(len(next(iter(per_step.values()))))
        ]
        rewards = [RewardSpec(**spec) for spec in run["rewards"]]
        watch = HackWatch(HackWatchConfig(), rewards)
        out = summary(run["run"], False, steps, watch, {})
        out["source"] = str(path)
        runs.append(out)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["runs", "task"], default="runs")
    parser.add_argument("--honest", nargs="*", type=Path, default=[])
    parser.add_argument("--gamed", nargs="*", type=Path, default=[])
    parser.add_argument("--gamed-json", nargs="*", type=Path, default=[])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.what == "task":
        write_task(TASK)
        return
    runs = [run_dir_summary(d, True) for d in args.honest]
    runs += [run_dir_summary(d, False) for d in args.gamed]
    runs += [run for path in args.gamed_json for run in json_runs(path)]
    args.out.write_text(json.dumps({"machine": common.machine(), "runs": runs}, indent=1) + "\n")
    for run in runs:
        kind = "honest" if run["honest"] else "gamed"
        said = ", ".join(f"{w['key']}@{w['step']}" for w in run["warnings"]) or "none"
        before = ", ".join(f"{w['key']}@{w['step']}" for w in run["before"]) or "none"
        print(f"{run['run']} ({kind}): warnings now: {said}; before: {before}")


if __name__ == "__main__":
    main()
