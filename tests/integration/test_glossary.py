"""Every metric a run logs is explained in the glossary, docs/metrics.md (honest, documented logging)."""

from __future__ import annotations

import json
from pathlib import Path

from metric_glossary import documented_metrics

from grpo.training.trainer import train


def _as_documented(key: str, functions: set[str]) -> str:
    parts = key.split("/")
    if parts[0] == "reward" and len(parts) == 3 and parts[1] in functions:
        return f"reward/<fn>/{parts[2]}"
    if parts[:2] == ["eval", "reward"] and len(parts) == 4 and parts[2] in functions:
        return f"eval/reward/<fn>/{parts[3]}"
    return key


def test_every_logged_metric_is_in_the_glossary(tiny_config, tmp_path: Path) -> None:
    reward = tmp_path / "noisy.py"  # varies within groups, so dynamic sampling keeps them
    reward.write_text(
        "def noisy(completions, **kw):\n"
        "    return [float(sum(map(ord, c)) % 7) for c in completions]\n"
    )
    config = tiny_config(
        rewards={"functions": [{"name": "format"}, {"name": f"{reward}:noisy"}]},
        algorithm={
            "beta": 0.1,
            "ref_update_every": 1,
            "top_entropy_quantile": 0.5,
            "entropy_coef": 0.01,
        },
        sampling={"dynamic": True, "max_rounds": 2, "greso": True},
        train={"steps": 2, "eval_every": 1, "eval_examples": 2},
    )
    run_dir = train(config)
    functions = {spec.name.rpartition(":")[2] for spec in config.rewards.functions}
    logged = set()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        logged |= {_as_documented(k, functions) for k in json.loads(line) if k != "step"}
    missing = logged - documented_metrics()
    assert not missing, f"metrics missing from the glossary (docs/metrics.md): {sorted(missing)}"
