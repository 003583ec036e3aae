"""Prompt curation: keep the training prompts the model solves sometimes, but not always.

A group whose G completions all get the same reward has zero advantage and teaches nothing
(``frac_zero_std``). ``grpo curate`` measures each training prompt before training: it samples
K completions with the recipe's model, engine, prompt format and sampling settings (at
``rollout.temperature``), scores them with the recipe's own reward functions (the reward runner
training uses), and keeps the prompts whose pass rate lies in a band.

- A completion **passes** when its total reward (the recipe's weighted sum) reaches
  ``threshold``: by default ``train.eval_reward_threshold`` (1.0), the same rule as
  ``grpo eval``'s ``reward/pass_rate``; with an ``accuracy`` reward of weight 1 beside smaller
  shaping terms, that is "the answer is right".
- A prompt's **pass rate** is passes / K. It is **kept** when ``low <= pass rate <= high``.

Files, for an output path ``OUT.jsonl``:

- ``OUT.scores.jsonl``: every scored prompt, its source row's columns plus ``source_row`` (the
  1-based row number in the data), ``sample_rewards`` (the K totals), ``pass_rate``,
  ``reward_mean``, ``reward_std`` and ``reward_means`` (each function's mean). Appended after
  every batch, so an interrupted run loses at most one batch: the same command resumes it, and
  a new band or threshold re-filters without sampling again.
- ``OUT.jsonl``: the kept rows, exactly as the data holds them (same columns), so the recipe's
  ``data.prompt_field`` / ``answer_field`` read them as before (``data.path=OUT.jsonl``).
- ``OUT.yaml``: the recipe, resolved, training on ``OUT.jsonl``; a built-in task's system prompt
  is written into it, and its held-out split into ``OUT.heldout.jsonl`` (``data.eval_path``).
- ``OUT.curate.json``: the settings the samples depend on (a resume must match them) and the
  summary (pass-rate histogram, share of zero-variance groups, rows kept, prompts sampled by
  this invocation and its sampling seconds).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config, ConfigError
from grpo.data import DataError, Rows, heldout_rows, load_dataset_rows, system_prompt_for
from grpo.rewards import RewardOutput
from grpo.runs.directory import write_atomic

# columns curation adds to a scored row; the data may not already have them
SCORE_COLUMNS = (
    "source_row",
    "sample_rewards",
    "pass_rate",
    "reward_mean",
    "reward_std",
    "reward_means",
)


@dataclass(frozen=True)
class CurateSettings:
    """``samples`` (K) completions per prompt; kept when ``band[0] <= pass rate <= band[1]``; a
    completion passes when its total reward >= ``threshold``; ``batch_size`` completions per
    generation call; ``limit``: only the first N prompts."""

    samples: int = 8
    band: tuple[float, float] = (0.1, 0.9)
    threshold: float = 1.0
    batch_size: int = 64
    limit: int | None = None


@dataclass(frozen=True)
class CuratePaths:
    kept: Path
    scores: Path
    recipe: Path
    heldout: Path
    meta: Path

    @classmethod
    def of(cls, kept: Path) -> CuratePaths:
        stem = kept.with_suffix("")
        return cls(
            kept=kept,
            scores=stem.with_name(f"{stem.name}.scores.jsonl"),
            recipe=stem.with_suffix(".yaml"),
            heldout=stem.with_name(f"{stem.name}.heldout.jsonl"),
            meta=stem.with_name(f"{stem.name}.curate.json"),
        )


# ------------------------------------------------------------------------------ pure functions


def group_scores(output: RewardOutput, samples: int) -> list[dict[str, Any]]:
    """Per prompt (groups of ``samples`` contiguous completions): the K totals and each
    function's mean over the completions it applied to (None when it applied to none)."""
    totals = output.total.view(-1, samples)  # [P, K]
    per_function = output.per_function.view(totals.shape[0], samples, -1)  # [P, K, F]
    out = []
    for p in range(totals.shape[0]):
        means = {}
        for k, name in enumerate(output.names):
            column = per_function[p, :, k]
            valid = column[~column.isnan()]
            means[name] = float(valid.mean()) if valid.numel() else None
        out.append({"sample_rewards": totals[p].tolist(), "reward_means": means})
    return out


def pass_rate(sample_rewards: list[float], threshold: float) -> float:
    """Share of the samples whose total reward reaches ``threshold``."""
    return sum(r >= threshold for r in sample_rewards) / len(sample_rewards)


def score_columns(
    source_row: int, sample_rewards: list[float], reward_means: dict[str, Any], threshold: float
) -> dict[str, Any]:
    """The columns curation adds to a row (population std, as the advantage's)."""
    rewards = torch.tensor(sample_rewards, dtype=torch.float64)
    return {
        "source_row": source_row,
        "sample_rewards": sample_rewards,
        "pass_rate": pass_rate(sample_rewards, threshold),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(correction=0)),
        "reward_means": reward_means,
    }


def in_band(rate: float, band: tuple[float, float]) -> bool:
    return band[0] <= rate <= band[1]


def summarize(
    records: list[dict[str, Any]], settings: CurateSettings, skipped: int
) -> dict[str, Any]:
    """Counts for the console and OUT.curate.json: how many prompts were kept, the histogram of
    passes out of K, and the share of zero-variance groups (all K totals equal) before and
    after the filter: what ``frac_zero_std`` would read at the first step."""
    k = settings.samples
    kept = [r for r in records if in_band(r["pass_rate"], settings.band)]

    def zero_std(rows: list[dict[str, Any]]) -> float | None:
        return sum(r["reward_std"] == 0 for r in rows) / len(rows) if rows else None

    passes = Counter(round(r["pass_rate"] * k) for r in records)
    return {
        "prompts": len(records),
        "kept": len(kept),
        "skipped_rows": skipped,
        "samples": k,
        "band": list(settings.band),
        "threshold": settings.threshold,
        "pass_rate_mean": sum(r["pass_rate"] for r in records) / len(records),
        "passes_histogram": {f"{n}/{k}": passes.get(n, 0) for n in range(k + 1)},
        "zero_std_frac": zero_std(records),
        "zero_std_frac_kept": zero_std(kept),
    }


def sample_settings(config: Config, samples: int) -> dict[str, Any]:
    """What the sampled rewards depend on; a resume must match it. The band and threshold are
    left out: they are applied to the stored rewards."""
    dump = config.model_dump(mode="json")
    data = {
        k: v for k, v in dump["data"].items() if k not in ("shuffle", "eval_path", "num_examples")
    }
    rollout = {
        k: v
        for k, v in dump["rollout"].items()
        if k not in ("prompts_per_step", "group_size") and not k.startswith("vllm_gpu")
    }
    return {
        "samples": samples,
        "seed": config.train.seed,
        "model": {k: dump["model"][k] for k in ("name", "dtype")},
        "data": data,
        "rollout": rollout,
        "rewards": {k: dump["rewards"][k] for k in ("functions", "fallback")},
    }


# ------------------------------------------------------------------------------------- files


def _json_line(row: dict[str, Any], where: str) -> str:
    try:
        return json.dumps(row, ensure_ascii=False) + "\n"
    except (TypeError, ValueError) as err:
        raise DataError(f"{where} cannot be written as JSON ({err})") from None


def default_output(config: Config) -> Path:
    """Next to the data file (``data.jsonl`` -> ``data.curated.jsonl``), or for a built-in task
    ``<task>-<split>.curated.jsonl`` in the working directory."""
    data = config.data
    if data.path is not None:
        path = Path(data.path)
        base = path if path.is_dir() else path.with_suffix("")
        return base.with_name(f"{base.name}.curated.jsonl")
    return Path(f"{data.task}-{data.split}.curated.jsonl")


def read_scores(paths: CuratePaths, settings: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The rows an earlier run scored (source_row -> record), after checking it sampled with
    the same settings. A partial last line (a kill mid-write) is dropped with a warning."""
    from grpo.config.diff import config_changes, describe_changes

    if not paths.scores.exists():
        return {}
    if not paths.meta.is_file():
        raise DataError(f"{paths.scores} exists without {paths.meta.name}: delete it to start over")
    try:
        old = json.loads(paths.meta.read_text())["settings"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"{paths.meta} is damaged: delete it and {paths.scores.name}") from None
    changes = config_changes(old, settings)
    if changes:
        raise DataError(
            f"{paths.scores} was sampled with other settings ({describe_changes(changes)}): "
            "pass --output elsewhere, or delete it to start over"
        )
    text = paths.scores.read_text()
    lines = text.split("\n")
    done: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: cut short by a kill
                print(
                    f"warning: {paths.scores}: dropped a partial last line; its prompt is "
                    "sampled again",
                    file=sys.stderr,
                )
                continue
            raise DataError(f"{paths.scores}: line {number} is not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("source_row"), int):
            raise DataError(f"{paths.scores}: line {number} has no 'source_row'")
        done[record["source_row"]] = record
    if text and not text.endswith("\n"):  # new batches are appended after whole lines only
        write_atomic(paths.scores, "".join(_json_line(r, "") for r in done.values()))
    return done


def source_of(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in SCORE_COLUMNS}


def curated_recipe(config: Config, paths: CuratePaths, heldout: bool) -> dict[str, Any]:
    """The resolved recipe, training on the kept rows: paths absolute (the recipe may live
    elsewhere), the system prompt written out (a task's own is lost once data.path is set)."""
    tree = config.model_dump(mode="json")
    if Path(config.model.name).exists():
        tree["model"]["name"] = str(Path(config.model.name).resolve())
    for spec in tree["rewards"]["functions"]:
        if ".py:" in spec["name"]:
            file, _, fn = spec["name"].rpartition(":")
            spec["name"] = f"{Path(file).resolve()}:{fn}"
    data = tree["data"]
    eval_path = data["eval_path"]
    if heldout:
        eval_path = paths.heldout.name
    elif eval_path is not None:
        eval_path = str(Path(eval_path).resolve())
    data.update(
        path=paths.kept.name,  # read from the recipe's folder
        task=None,
        task_args={},
        split="train",
        num_examples=None,
        system_prompt=system_prompt_for(config.data),
        eval_path=eval_path,
    )
    tree["train"]["run_name"] = f"{config.train.run_name}-curated"
    return tree


def heldout_sources(config: Config) -> list[dict[str, Any]] | None:
    """The held-out rows of a task or a datasets folder as the data holds them (a file needs
    none written: data.eval_path stays as it is, or there is none)."""
    if config.data.eval_path is not None:
        return None
    if config.data.path is not None and not Path(config.data.path).is_dir():
        return None
    # all of them: with data.eval_unseen the curated run leaves out what its own rows ask
    every = config.data.model_copy(update={"eval_unseen": False})
    try:
        return heldout_rows(every, config.train.seed).sources
    except DataError:  # no test split: the recipe trains without held-out evaluation
        return None


# ------------------------------------------------------------------------------------- run


def batches(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def selected_rows(config: Config, settings: CurateSettings) -> Rows:
    rows = load_dataset_rows(config.data, config.train.seed)
    if settings.limit is not None:
        for part in (rows, rows.sources, rows.numbers):
            del part[settings.limit :]
    for number, source in zip(rows.numbers, rows.sources, strict=True):
        clash = [c for c in SCORE_COLUMNS if c in source]
        if clash:
            raise DataError(
                f"data row {number} already has the column '{clash[0]}' that curation adds "
                "(curate the kept rows, not a .scores.jsonl file)"
            )
    return rows


def _output_paths(output: Path) -> CuratePaths:
    paths = CuratePaths.of(output)
    if paths.kept.suffix != ".jsonl":
        raise ConfigError(f"--output {paths.kept}: the kept rows are written as JSONL (.jsonl)")
    if not paths.kept.parent.is_dir():
        raise ConfigError(f"--output {paths.kept}: folder {paths.kept.parent} does not exist")
    return paths


def _check_same_data(rows: Rows, done: dict[int, dict[str, Any]], paths: CuratePaths) -> None:
    """Refuse to resume over stored scores of rows the data no longer holds as it did."""
    for number, source in zip(rows.numbers, rows.sources, strict=True):
        as_stored = json.loads(_json_line(source, f"data row {number}"))
        if number in done and source_of(done[number]) != as_stored:
            raise DataError(
                f"{paths.scores}: row {number} differs from the data's row {number} (the data "
                "changed since): pass --output elsewhere, or delete it to start over"
            )


def _score_missing(
    config: Config,
    settings: CurateSettings,
    rows: Rows,
    todo: list[int],
    done: dict[int, dict[str, Any]],
    paths: CuratePaths,
) -> float:
    """Sample and score the rows ``todo`` indexes into ``done``, saying so and any reward
    errors on stderr; returns the seconds it took."""
    print(
        f"curate: {len(todo)} prompts x {settings.samples} samples to score"
        + (f" ({len(rows) - len(todo)} already in {paths.scores})" if done else ""),
        file=sys.stderr,
    )
    start = time.perf_counter()
    scored, errors = sample_and_score(config, settings, rows, todo, paths.scores)
    sampling_s = time.perf_counter() - start
    done.update(scored)
    failing = {name: count for name, count in errors.items() if count}
    if failing:
        counts = ", ".join(f"{n} {c}/{len(todo) * settings.samples}" for n, c in failing.items())
        print(
            f"curate: reward errors (scored {config.rewards.fallback:g}): {counts}",
            file=sys.stderr,
        )
    return sampling_s


def _write_kept(
    paths: CuratePaths, records: list[dict[str, Any]], settings: CurateSettings
) -> None:
    """The rows whose pass rate is in the band, as the data holds them (a warning if none)."""
    kept = [r for r in records if in_band(r["pass_rate"], settings.band)]
    if not kept:
        print(
            f"warning: no prompt has a pass rate in [{settings.band[0]:g}, {settings.band[1]:g}]: "
            f"{paths.kept} is empty (see the pass rates in {paths.scores})",
            file=sys.stderr,
        )
    write_atomic(
        paths.kept, "".join(_json_line(source_of(r), f"row {r['source_row']}") for r in kept)
    )


def _write_recipe(config: Config, paths: CuratePaths, heldout: list[dict[str, Any]] | None) -> None:
    """The held-out rows (a task's or a datasets folder's) and the recipe training on the kept."""
    if heldout is not None:
        write_atomic(
            paths.heldout,
            "".join(_json_line(row, f"held-out row {i}") for i, row in enumerate(heldout, 1)),
        )
    import yaml

    write_atomic(
        paths.recipe,
        "# written by grpo curate: the recipe below, training on the kept prompts\n"
        + yaml.safe_dump(curated_recipe(config, paths, heldout is not None), sort_keys=False),
    )


def curate(config: Config, settings: CurateSettings, output: Path | None = None) -> dict[str, Any]:
    """Score every selected training prompt (resuming an earlier run's scores), write the files
    above, and return the summary (with the paths written)."""
    rows = selected_rows(config, settings)
    paths = _output_paths(output or default_output(config))
    wanted = sample_settings(config, settings.samples)
    done = read_scores(paths, wanted)
    _check_same_data(rows, done, paths)
    todo = [i for i, number in enumerate(rows.numbers) if number not in done]
    heldout = heldout_sources(config)
    if not paths.scores.exists():
        write_atomic(paths.meta, json.dumps({"settings": wanted}, indent=2) + "\n")
    sampling_s = _score_missing(config, settings, rows, todo, done, paths) if todo else 0.0
    records = [done[number] for number in rows.numbers]
    for record in records:  # the threshold of this run (the stored ones may be another's)
        record.update(
            score_columns(
                record["source_row"],
                record["sample_rewards"],
                record["reward_means"],
                settings.threshold,
            )
        )
    write_atomic(
        paths.scores,
        "".join(_json_line(done[n], f"row {n}") for n in sorted(done)),
    )
    _write_kept(paths, records, settings)
    _write_recipe(config, paths, heldout)
    summary = {
        **summarize(records, settings, rows.skipped),
        "sampled_now": len(todo),
        "sampling_s": round(sampling_s, 1),
    }
    write_atomic(paths.meta, json.dumps({"settings": wanted, "summary": summary}, indent=2) + "\n")
    return {**summary, "files": {k: str(v) for k, v in vars(paths).items()}}


def _progress_bar(enabled: bool) -> Any:
    """A rich progress bar of prompts scored: count, bar, mean pass rate, elapsed and eta."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("curate"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def _batch_records(
    judged: RewardOutput, chunk: list[int], rows: Rows, samples: int, threshold: float
) -> dict[int, dict[str, Any]]:
    """Data row number -> its scored record (source columns and score columns), for the rows
    ``chunk`` indexes, from the rewards of their ``samples`` completions each."""
    records = {}
    for i, scores in zip(chunk, group_scores(judged, samples), strict=True):
        number = rows.numbers[i]
        records[number] = {
            **rows.sources[i],
            **score_columns(number, **scores, threshold=threshold),
        }
    return records


def sample_and_score(
    config: Config,
    settings: CurateSettings,
    rows: Rows,
    todo: list[int],
    scores_path: Path,
) -> tuple[dict[int, dict[str, Any]], dict[str, int]]:
    """Sample K completions for each row index in ``todo`` with the recipe's model and engine,
    score them with its rewards, and append each batch's records to ``scores_path``.

    Row i's samples are seeded as the trainer seeds the prompt it draws at stream position i,
    so they depend on neither the batch nor a resume, and equal the first epoch's groups of an
    unshuffled run (``data.shuffle=false``). Returns the records and each reward function's error count."""
    from grpo.build import build_for_sampling, engine_of
    from grpo.data.stream import sampling_seed
    from grpo.rewards.inputs import reward_inputs
    from grpo.rollout import release

    k = settings.samples
    parts = build_for_sampling(config, [rows[i] for i in todo])
    tokenizer, prompt_format, rewards = parts.tokenizer, parts.prompt_format, parts.rewards
    try:
        engine = engine_of(config, parts.policy, tokenizer, None, parts.environment)
    except BaseException:
        rewards.close()
        raise
    progress = _progress_bar(config.train.progress)
    task = progress.add_task("curate", total=len(todo), info="")
    out: dict[int, dict[str, Any]] = {}
    rates: list[float] = []
    errors = dict.fromkeys(rewards.names, 0)
    try:
        with progress, scores_path.open("a") as log:
            for chunk in batches(todo, max(1, settings.batch_size // k)):
                batch = [rows[i] for i in chunk]
                rollout = engine.generate(
                    [prompt_format.render(tokenizer, row) for row in batch],
                    batch,
                    k,
                    seeds=[sampling_seed(config.train.seed, i) for i in chunk],
                )
                judged = rewards(*reward_inputs(rollout))
                for name, count in judged.errors.items():
                    errors[name] += count
                records = _batch_records(judged, chunk, rows, k, settings.threshold)
                out.update(records)
                rates.extend(r["pass_rate"] for r in records.values())
                log.write("".join(_json_line(r, f"data row {n}") for n, r in records.items()))
                log.flush()
                os.fsync(log.fileno())
                info = f"mean pass rate {sum(rates) / len(rates):.2f}"
                progress.update(task, advance=len(chunk), info=info)
    finally:
        rewards.close()
        release(engine)
    return out, errors
