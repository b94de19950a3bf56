"""The over-prediction warning fires once, only on a sustained streak, only with the spec's `keep`."""

from __future__ import annotations

from learner.stage2.over_prediction import OverPredictionAlarm


def _logs(pred: float, gt: float) -> dict[str, float]:
    return {"loss": 1.0, "rollout/pred_per_sample": pred, "rollout/gt_per_sample": gt}


def test_fires_once_after_a_streak_and_names_the_knob() -> None:
    alarm = OverPredictionAlarm("keep")
    seen = [alarm.observe(r) for r in [_logs(4, 2), _logs(4, 2), {"loss": 1.0}, _logs(4, 2), _logs(5, 2)]]
    assert seen[:3] == [None, None, None]  # a step without rollouts neither counts nor resets
    assert seen[3] is not None and "unmatched_prefix: reorder" in seen[3] and "2.00" in seen[3]
    assert seen[4] is None  # once


def test_a_step_at_the_ground_truth_count_resets_the_streak() -> None:
    alarm = OverPredictionAlarm("keep", ratio=1.3, steps=3)
    for logs in [_logs(3, 2), _logs(3, 2), _logs(2.5, 2), _logs(3, 2), _logs(3, 2)]:
        assert alarm.observe(logs) is None  # 2.5 / 2 = 1.25 is not above 1.3
    assert alarm.observe(_logs(3, 2)) is not None


def test_silent_with_drop_and_on_under_prediction() -> None:
    dropping = OverPredictionAlarm("drop")
    under = OverPredictionAlarm("keep")
    for _ in range(10):
        assert dropping.observe(_logs(9, 1)) is None
        assert under.observe(_logs(1, 3)) is None
        assert under.observe(_logs(1, 0)) is None  # no GT objects: no ratio
