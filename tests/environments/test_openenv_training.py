"""Training runs against OpenEnv servers: an environment class trains the same in process and
served through ``openenv-core`` (``grpo env-serve``'s app), a server absent at start is one line
(exit 2), and a server that dies mid-run stops the run in one line with its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.environments.classes import ClassEnvironment, load_class
from grpo.rollout.turns import EnvironmentLost
from grpo.training.trainer import train

# found, not imported: openenv-core brings gradio (seconds), paid only where these tests run
pytestmark = pytest.mark.skipif(
    find_spec("openenv") is None, reason="the envs extra (make test installs it)"
)

HERE = Path(__file__).parent
GUESS = f"{HERE / 'trl_envs.py'}:GuessNumber"
TIMED = ("time/", "env/time_s", "tokens_per_s", "rollout/tokens_per_s")


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if not k.startswith(TIMED)}
        for row in rows
        if "event" not in row
    ]


def _config(tiny_config, environment: str, name: str, **train):
    return tiny_config(
        rollout={"environment": environment, "max_new_tokens": 16, "max_turns": 3},
        rewards={"functions": [{"name": "environment"}, {"name": "format", "weight": 0.5}]},
        train={"run_name": name, **train},
    )


def test_a_class_trains_the_same_in_process_and_served_through_openenv(tiny_config) -> None:
    from openenv_game import serving

    from grpo.environments.openenv_serve import app_for

    local = _metrics(train(_config(tiny_config, GUESS, "local")))
    environment = ClassEnvironment(load_class(GUESS), "fence")
    with serving(app_for(environment, sessions=16)) as url:
        before = set(threading.enumerate())
        served = _metrics(train(_config(tiny_config, f"openenv+{url}", "served")))
        started = set(threading.enumerate()) - before
    assert served == local
    # the run closed its environment: the sessions' event loop ended with it
    assert not [t.name for t in started if t.is_alive() and "run_forever" in t.name]
    assert len(local) == 2 and local[0]["env/turns"] >= 1.0


def test_the_prompt_format_of_grpo_serve_closes_the_environment_it_built(tiny_config) -> None:
    # grpo serve needs the environment's tools for its prompts, and plays no episode
    from openenv_game import serving

    from grpo.build import episodeless_prompt_format
    from grpo.environments.openenv_serve import app_for

    environment = ClassEnvironment(load_class(GUESS), "template")
    with serving(app_for(environment, sessions=2)) as url:
        config = _config(tiny_config, f"openenv+{url}?action=tool", "serve")
        config = config.model_copy(
            update={"rollout": config.rollout.model_copy(update={"tool_call_format": "template"})}
        )
        before = set(threading.enumerate())
        fmt = episodeless_prompt_format(config)
        started = set(threading.enumerate()) - before
    assert [t["function"]["name"] for t in fmt.tools] == ["guess"]
    assert not [t.name for t in started if t.is_alive() and "run_forever" in t.name]


def test_a_server_absent_at_start_is_one_line_and_exit_2(tiny_config, tmp_path, capsys) -> None:
    from openenv_game import free_port

    port = free_port()  # nothing listens there
    recipe = tmp_path / "recipe.yaml"
    config = _config(tiny_config, f"openenv+http://127.0.0.1:{port}", "absent")
    recipe.write_text(json.dumps(config.model_dump(mode="json")))
    code = main(["train", str(recipe)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and f"no OpenEnv server answers at http://127.0.0.1:{port}" in err[0]


def test_a_server_that_dies_mid_run_stops_it_with_its_last_checkpoint(tiny_config) -> None:
    from openenv_game import free_port

    port = free_port()
    # 2 prompts x 4 completions: 8 sessions a step; the 17th reset (step 3's) kills the server
    server = subprocess.Popen([sys.executable, str(HERE / "openenv_game.py"), str(port), "17"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        config = _config(tiny_config, f"openenv+{url}", "dies", steps=4)
        with pytest.raises(EnvironmentLost) as lost:
            train(config)
        said = str(lost.value)
        assert "\n" not in said
        assert said.startswith(f"openenv {url}: no session after 3 attempts (")
        assert "; the server is gone before step 3: " in said
        assert said.endswith("runs/dies/checkpoints/step-2 is complete")
        run_dir = Path(config.train.output_dir) / "dies"
        assert (run_dir / "checkpoints" / "step-2").is_dir()
        assert len(_metrics(run_dir)) == 2
    finally:
        server.kill()
        server.wait()
