"""Start-up: `import grpo`, `grpo --help` and `grpo config` load neither torch nor transformers,
and importing grpo leaves the environment as it found it. Each check runs in a fresh interpreter,
since this one has long imported both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import grpo

HEAVY = ("torch", "transformers")
SRC = str(Path(grpo.__file__).parents[1])  # the grpo under test, not an installed one


def _fresh(code: str) -> dict:
    """Run `code` in a new interpreter; it prints one JSON object as its last line."""
    path = [SRC, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def _loaded_after(statements: str) -> dict:
    return _fresh(
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        f"{statements}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "changed = sorted(k for k in set(before) | set(os.environ)"
        " if before.get(k) != os.environ.get(k))\n"
        "print(json.dumps({'heavy': heavy, 'changed': changed}))"
    )


def test_import_grpo_loads_no_torch_and_keeps_the_environment() -> None:
    seen = _loaded_after("import grpo; grpo.Config; grpo.load_config")
    assert seen == {"heavy": [], "changed": []}


def test_the_trainer_still_comes_from_the_package() -> None:
    from grpo.training import Trainer, train

    assert grpo.Trainer is Trainer and grpo.train is train
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        grpo.nothing  # noqa: B018


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["config"]])
def test_help_and_config_load_no_torch(argv: list[str]) -> None:
    seen = _loaded_after(
        "import contextlib, io\n"
        "from grpo.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})"
    )
    assert seen["heavy"] == []


def test_a_reward_worker_imports_a_built_in_without_torch() -> None:
    # a worker process that runs the reasoning-gym verifier imports it through grpo.rewards:
    # the runner (and torch with it) stays out, so the worker starts in a fraction of the time
    seen = _loaded_after("import grpo.rewards.reasoning_gym")
    assert seen["heavy"] == []
    from grpo.rewards import RewardRunner, runner

    assert RewardRunner is runner.RewardRunner


def test_grpo_serve_refuses_its_address_before_torch_loads() -> None:
    # the address is bound (or refused) first: a wrong one is said at once, not after the
    # seconds torch, transformers' models and the model take
    refusals = [
        (["--port", "99999"], "a port is 0-65535"),
        (["--token", "short"], "a token of at least 16 characters"),
        (["--host", "0.0.0.0"], "answers beyond this machine: give it a token"),
    ]
    seen = _loaded_after(
        "import contextlib, io\n"
        "from grpo.cli import main\n"
        f"for flags, said in {refusals!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = main(['serve', 'some/model', *flags])\n"
        "    assert code == 2 and said in err.getvalue(), (code, err.getvalue())"
    )
    assert not [m for m in seen["heavy"] if m.split(".")[0] == "torch"]
