"""``grpo report RUN_DIR``: one static report.html with the run's curves and sample completions.

Reads ``metrics.jsonl``, ``completions/step-*.jsonl`` and ``config.yaml`` from the run directory;
plots are PNGs (matplotlib, Agg backend) embedded as data URIs, so the file needs no server and
no neighbouring files.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.runs.directory import read_jsonl

SUMMARY_WINDOW = 10  # steps averaged at the start and at the end of the run
SMOOTH_FROM = 10  # series this long get a running mean drawn over the raw values
SMOOTH_WINDOW = 5


class ReportError(ValueError):
    """A run directory that cannot be reported on; one line for the user."""


# --------------------------------------------------------------------------------------- reading


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    rows, bad = read_jsonl(path)
    last = len(path.read_text().splitlines())
    if [n for n in bad if n != last]:
        raise ReportError(f"{path}: line {bad[0]} is not valid JSON")
    if bad:  # a run killed mid-write leaves a partial last line
        print(f"grpo: warning: {path}: skipped the partial last line {last}")
    return rows


def read_completions(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """step -> the sampled completions logged at that step."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((run_dir / "completions").glob("step-*.jsonl")):
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        out[int(path.stem.split("-")[1])] = [json.loads(ln) for ln in lines]
    return out


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping steps where it is missing or NaN."""
    points = [
        (r["step"], float(r[key]))
        for r in rows
        if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])
    ]
    return [s for s, _ in points], [v for _, v in points]


def running_mean(values: list[float], window: int = SMOOTH_WINDOW) -> list[float]:
    """Trailing mean over up to ``window`` values: [1, 2, 3] with window 2 -> [1, 1.5, 2.5]."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(values))
    ]


def window_mean(values: list[float], first: bool, size: int = SUMMARY_WINDOW) -> float:
    chunk = values[:size] if first else values[-size:]
    return sum(chunk) / len(chunk) if chunk else math.nan


# --------------------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Plot:
    """One figure: a title and the metric keys (or key prefixes ending in '/') it draws."""

    title: str
    keys: tuple[str, ...]
    ylabel: str = ""


def reward_keys(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """reward/mean and every reward/<fn>/mean seen in the run."""
    names = sorted({k for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean")})
    return ("reward/mean", *[k for k in names if k != "reward/mean"])


def eval_keys(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    names = {k for r in rows for k in r if k.startswith("eval/")}
    scores = ("accuracy", "answer_rate")
    return tuple(
        sorted(k for k in names if k.split("/", 1)[1].startswith(("pass@", "maj@", *scores)))
    )


def hack_keys(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """Every hack/* signal the run logged (grpo.training.hack_watch)."""
    return tuple(sorted({k for r in rows for k in r if k.startswith("hack/")}))


def plots_for(rows: list[dict[str, Any]]) -> list[Plot]:
    return [
        Plot("Reward (total and per function)", reward_keys(rows), "mean reward"),
        Plot("Held-out evaluation", eval_keys(rows), "share of problems"),
        Plot("KL to the reference", ("kl",)),
        Plot("Policy entropy (nats per token)", ("entropy",)),
        Plot("Completion length (tokens)", ("completion_len/mean",)),
        Plot("Clip fractions", ("clip_frac/low", "clip_frac/high"), "share of tokens"),
        Plot("Groups with zero reward variance", ("frac_zero_std",), "share of groups"),
        Plot("Reflection rate (self-check phrases)", ("reflection_rate",), "share of completions"),
        Plot("Truncated completions", ("truncated_frac",), "share of completions"),
        Plot(
            "Reward-hacking signals (docs/rewards.md)", hack_keys(rows), "share, or 1 when flagged"
        ),
    ]


def render_plot(plot: Plot, rows: list[dict[str, Any]]) -> bytes | None:
    """PNG bytes, or None when the run logged none of the plot's metrics."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lines = [(key, *series(rows, key)) for key in plot.keys]
    lines = [line for line in lines if line[1]]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    try:
        for key, steps, values in lines:
            if len(values) < SMOOTH_FROM:
                ax.plot(steps, values, marker="o", markersize=3, label=key)
                continue
            # per-step values are noisy (a handful of prompts each): faint raw, bold running mean
            (raw,) = ax.plot(steps, values, alpha=0.3, linewidth=1)
            label = f"{key} ({SMOOTH_WINDOW}-step mean)"
            ax.plot(steps, running_mean(values), color=raw.get_color(), linewidth=2, label=label)
        ax.set_title(plot.title)
        ax.set_xlabel("step")
        ax.set_ylabel(plot.ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------- html


def _fmt(value: float) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.3f}"


def summary(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(metric, first, last): reward over the first/last steps, eval before/after training."""
    out = []
    keys = ("reward/mean", *reward_keys(rows)[1:], "completion_len/mean", "reflection_rate")
    for key in (*keys, "hack/template_copy", "hack/question_restated"):
        _, values = series(rows, key)
        if values:
            label = f"{key} (mean of first / last {SUMMARY_WINDOW} steps)"
            out.append((label, _fmt(window_mean(values, True)), _fmt(window_mean(values, False))))
    for key in eval_keys(rows):
        steps, values = series(rows, key)
        if values:
            out.append(
                (f"{key} (step {steps[0]} / step {steps[-1]})", _fmt(values[0]), _fmt(values[-1]))
            )
    return out


def completion_table(records: list[dict[str, Any]]) -> str:
    cells = []
    for r in records:
        rewards = ", ".join(
            f"{k}={_fmt(v) if v is not None else 'n/a'}" for k, v in r.get("rewards", {}).items()
        )
        cells.append(
            "<tr>"
            f"<td><pre>{html.escape(str(r.get('prompt', '')))}</pre></td>"
            f"<td><pre>{html.escape(str(r.get('completion', '')))}</pre></td>"
            f"<td>{_fmt(float(r.get('reward', math.nan)))}<br><small>{html.escape(rewards)}</small></td>"
            "</tr>"
        )
    head = "<tr><th>prompt</th><th>completion</th><th>reward</th></tr>"
    return f"<table class='samples'>{head}{''.join(cells)}</table>"


def samples_section(completions: dict[int, list[dict[str, Any]]], per_side: int = 4) -> str:
    if not completions:
        return "<p>No completions were logged (train.log_completions = 0).</p>"
    steps = sorted(completions)
    early, late = steps[0], steps[-1]
    parts = [f"<h3>Early: step {early}</h3>", completion_table(completions[early][:per_side])]
    if late != early:
        parts += [f"<h3>Late: step {late}</h3>", completion_table(completions[late][:per_side])]
    return "".join(parts)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plots img { width: 540px; border: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
pre { white-space: pre-wrap; margin: 0; max-width: 480px; font-size: 12px; }
"""


def build_html(
    run_dir: Path, rows: list[dict[str, Any]], images: dict[str, bytes], samples: str
) -> str:
    config = run_dir / "config.yaml"
    config_text = config.read_text() if config.is_file() else "(no config.yaml)"
    summary_rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{a}</td><td>{b}</td></tr>" for k, a, b in summary(rows)
    )
    figures = "".join(
        f"<img alt='{html.escape(title)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        for title, png in images.items()
    )
    last_step = max((r["step"] for r in rows), default=0)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>grpo report: {html.escape(run_dir.name)}</title><style>{STYLE}</style></head><body>"
        f"<h1>Run {html.escape(run_dir.name)}</h1><p>{last_step} steps · {html.escape(str(run_dir))}</p>"
        "<h2>Summary</h2><table><tr><th>metric</th><th>first</th><th>last</th></tr>"
        f"{summary_rows}</table>"
        f"<h2>Curves</h2><div class='plots'>{figures}</div>"
        f"<h2>Sampled completions, early vs late</h2>{samples}"
        f"<h2>Config</h2><pre>{html.escape(config_text)}</pre>"
        "</body></html>"
    )


def write_report(run_dir: str | Path) -> Path:
    """Write <run_dir>/report.html and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory not found: {run_dir}")
    rows = read_metrics(run_dir)
    plots = plots_for(rows)
    images = {plot.title: png for plot in plots if (png := render_plot(plot, rows)) is not None}
    out = run_dir / "report.html"
    out.write_text(build_html(run_dir, rows, images, samples_section(read_completions(run_dir))))
    return out
