"""The reward-hacking watch replayed over recorded runs: which lines it gives on each run, from
the run's ``metrics.jsonl`` (the ``hack/*`` signals, the accuracy rewards' means) and its
``completions/`` (all of a step's completions, ``train.log_completions`` >= P x G, for the
template-copy line of a run with ``data.few_shot``). The numbers behind
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
from grpo.config import Config, HackWatchConfig, RewardSpec, load_config
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.models.aliases import resolve_model_path
from grpo.models.loading import load_tokenizer
from grpo.rewards.copying import copies, template_ngrams
from grpo.training.hack_watch import HackWatch, Said, row_texts

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


def own_copy_share(
    records: list[dict[str, Any]], rows: dict[str, dict[str, Any]], examples: list[str], n: int
) -> float:
    """Share of a step's completions that copy their prompt's own text, the worked examples and
    the row's question cut out (``hack_watch.template_copy_share`` over the logged records)."""
    flags = []
    for record in records:
        cut = [*examples, *row_texts(rows[record["prompt"]]["prompt"])]
        answer = record["turns"][-1]["text"] if "turns" in record else record["completion"]
        flags.append(copies(answer, template_ngrams(record["prompt"], cut, n), n))
    return sum(flags) / len(flags) if flags else 0.0


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


def replay(steps: list[dict[str, Any]], watch: HackWatch, own_copy: dict[int, float]) -> list[Said]:
    """The lines ``watch`` gives over recorded ``steps``; ``own_copy``: a step's template-copy
    share without the worked examples, where it differs from ``hack/template_copy``."""
    lines: list[Said] = []
    for row in steps:
        values = {k: v for k, v in row.items() if k in watch.thresholds}
        own = own_copy.get(row["step"], row.get("hack/template_copy", 0.0))
        lines += watch.speak(row["step"], values, row, own)
    return lines


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(
    name: str,
    honest: bool,
    steps: list[dict[str, Any]],
    watch: HackWatch,
    own_copy: dict[int, float],
) -> dict[str, Any]:
    lines = replay(steps, watch, own_copy)
    warnings = [{"step": s.step, "key": s.key} for s in lines if s.warning]
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
        "notes": [{"step": s.step, "key": s.key} for s in lines if not s.warning],
        "first_warning": warnings[0]["step"] if warnings else None,
        "copy_recomputed_steps": sorted(own_copy),
    }


def run_dir_summary(run_dir: Path, honest: bool) -> dict[str, Any]:
    config = load_config(run_dir / "config.yaml")
    examples = [turn.content for turn in config.data.few_shot]
    watch = HackWatch(config.train.hack_watch, config.rewards.functions, examples)
    steps = step_rows(run_dir)
    own_copy: dict[int, float] = {}
    if watch.examples:
        rows = rows_by_prompt(config)
        per_step = config.rollout.prompts_per_step * config.rollout.group_size
        for row in steps:
            path = run_dir / "completions" / f"step-{row['step']:06d}.jsonl"
            records = [json.loads(x) for x in path.read_text().splitlines()]
            if len(records) < per_step:
                raise SystemExit(f"{path}: {len(records)} completions of {per_step}")
            own_copy[row["step"]] = own_copy_share(
                records, rows, watch.examples, config.train.hack_watch.copy_ngram
            )
    out = summary(run_dir.name, honest, steps, watch, own_copy)
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
