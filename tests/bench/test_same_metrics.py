"""What ``benchmarks.infra.same_metrics`` counts as the same run."""

from benchmarks.infra.same_metrics import differences


def test_timings_are_left_out_nan_equals_nan_and_any_other_change_is_named() -> None:
    a = [{"step": 1, "loss": 0.5, "kl": float("nan"), "time/rollout_s": 1.0, "tokens_per_s": 9.0}]
    same = [{"step": 1, "loss": 0.5, "kl": float("nan"), "time/rollout_s": 2.0, "tokens_per_s": 3}]
    assert differences(a, same) == ([], [])
    moved = [{**same[0], "loss": 0.5000001}]
    assert differences(a, moved) == (["step 1 loss: 0.5 != 0.5000001"], [])
    assert differences(a, a + a) == (["1 rows against 2"], [])


def test_a_new_metric_is_listed_apart_and_a_lost_one_is_a_difference() -> None:
    a = [{"step": 1, "loss": 0.5, "kl": 0.1}]
    extra = [{**a[0], "eval/accuracy": 1.0}]
    assert differences(a, extra) == ([], ["eval/accuracy"])
    lost = [{"step": 1, "loss": 0.5}]
    assert differences(a, lost) == (["step 1 kl: 0.1 != None"], [])
