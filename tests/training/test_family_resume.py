"""Every estimator, loss type and reward aggregation on the tiny model: a run moves the weights,
and a run stopped after step 2 and resumed ends bit for bit where the uninterrupted one does."""

from __future__ import annotations

import pytest
from run_logs import step_rows

from grpo.training.trainer import Trainer, train

FAMILY = {
    "grpo": {},
    "rloo": {"estimator": "rloo"},
    "reinforce_pp": {"estimator": "reinforce_pp", "beta": 0.05},
    "ppo": {"estimator": "ppo", "beta": 0.05, "critic_lr": 1e-3},
    "bnpo": {"loss_type": "bnpo"},
    "dapo": {"loss_type": "dapo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "cispo": {"loss_type": "cispo"},
    "sapo": {"loss_type": "sapo"},
    "gspo": {"ratio_level": "sequence"},
    "gdpo": {"reward_aggregation": "gdpo"},
}


class Stop(Exception):
    pass


@pytest.mark.parametrize("algorithm", FAMILY.values(), ids=FAMILY.keys())
def test_each_member_trains_and_resumes_bit_for_bit(
    tiny_config, tiny_model_dir, weights, monkeypatch, algorithm: dict
) -> None:
    def config(run: str, **train_args: object):
        return tiny_config(
            algorithm={"num_iterations": 2, **algorithm},
            optim={"lr": 1e-2},
            train={"steps": 3, "save_every": 1, "threads": 1, "run_name": run, **train_args},
        )

    straight = train(config("straight"))
    weights.assert_moved(weights.of(tiny_model_dir), weights.of(straight / "final"))
    update = Trainer.optimize

    def stop_in_step_3(self: Trainer, scored):
        if self.state.step == 3:
            raise Stop
        return update(self, scored)

    monkeypatch.setattr(Trainer, "optimize", stop_in_step_3)
    with pytest.raises(Stop):
        train(config("stopped"))
    monkeypatch.undo()
    resumed = train(config("stopped", resume="auto"))
    a, b = weights.of(straight / "final"), weights.of(resumed / "final")
    assert all(a[k].equal(b[k]) for k in a)

    assert step_rows(resumed) == step_rows(straight)
