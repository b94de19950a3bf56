"""GT extraction and ordering (docs/ALGORITHM.md#records §1.2–§1.4, §7; required tests §20.1)."""

from __future__ import annotations

import logging

import pytest

from learner.stage2.gt import (
    GTObject,
    MalformedGTError,
    MalformedLogLimiter,
    extract_gt,
    object_anchor,
    order_objects,
)

GOOD = {"desc": "cat", "bbox_2d": ["<|coord_156|>", "<|coord_415|>", "<|coord_467|>", "<|coord_832|>"]}
MALFORMED = {
    "both geometries": {"desc": "a", "bbox_2d": [1, 2, 3, 4], "poly": [1, 2, 3, 4, 5, 6]},
    "empty desc": {"desc": "  ", "bbox_2d": [1, 2, 3, 4]},
    "3 bbox values": {"desc": "a", "bbox_2d": [1, 2, 3]},
    "poly of 5 values": {"desc": "a", "poly": [1, 2, 3, 4, 5]},
    "mixed forms": {"desc": "a", "bbox_2d": ["<|coord_3|>", 7, 8, 9]},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_objects_are_counted_logged_and_excluded(case, caplog):
    lim = MalformedLogLimiter(log_max=20)
    objs = [
        GOOD,
        MALFORMED[case],
        {"desc": "sofa", "poly": [40, 500, 900, 520, 880, 990, 30, 980], "poly_points": 4},
    ]
    with caplog.at_level(logging.WARNING, logger="learner.stage2.gt"):
        ex = extract_gt(objs, sample_id=(3 << 32) | 17, limiter=lim)
    assert ex.n_malformed == 1 and ex.malformed[0][0] == 2  # rollout/gt_malformed
    assert [o.index for o in ex.objects] == [1, 3]  # neither matched nor appended: it is not an object at all
    assert ex.objects[0] == GTObject(1, "cat", "bbox_2d", (156, 415, 467, 832))
    assert ex.objects[1].bins == (40, 500, 900, 520, 880, 990, 30, 980)
    (rec,) = caplog.records
    assert str((3 << 32) | 17) in rec.getMessage() and "position 2" in rec.getMessage()


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_policy_raise(case):
    with pytest.raises(MalformedGTError) as err:
        extract_gt([GOOD, MALFORMED[case]], sample_id=5, policy="raise")
    assert err.value.position == 2 and err.value.sample_id == 5


@pytest.mark.parametrize(
    "obj",
    [
        "not a dict",
        {"desc": "a"},
        {"desc": 3, "bbox_2d": [1, 2, 3, 4]},
        {"desc": "a", "bbox_2d": None, "poly": None},
        {"desc": "a", "bbox_2d": [1, 2, 3, True]},
        {"desc": "a", "bbox_2d": [1, 2, 3, 1000]},
        {"desc": "a", "bbox_2d": [1, 2, 3, float("nan")]},
        {"desc": "a", "poly": [[1, 2], [3, 4], [5, 6]], "poly_points": 4},
        {"desc": "a", "poly": [[1, 2], [3, 4], 5, 6]},
        {"desc": "a", "poly": [[1, 2, 3], [3, 4], [5, 6]]},
        {"desc": "a", "bbox_2d": "1 2 3 4"},
    ],
)
def test_more_malformed_cases(obj):
    ex = extract_gt([obj], sample_id=0, limiter=MalformedLogLimiter(0))
    assert ex.objects == [] and ex.n_malformed == 1


def test_accepted_forms():
    objs = [
        {"desc": "a", "poly": [[1, 2], [3, 4], [5, 6]]},  # pairs are flattened
        {"desc": "b", "bbox_2d": [1.5, 2.5, 3.0, 4], "extra": "ignored"},  # floats rounded half-to-even
        {"desc": "c", "bbox_2d": [1, 2, 3, 4], "poly": None},  # null geometry counts as absent
    ]
    ex = extract_gt(objs, sample_id=0)
    assert [o.bins for o in ex.objects] == [(1, 2, 3, 4, 5, 6), (2, 2, 3, 4), (1, 2, 3, 4)]
    assert ex.n_malformed == 0


def test_log_cap_then_summary(caplog):
    lim = MalformedLogLimiter(log_max=2)
    with caplog.at_level(logging.WARNING, logger="learner.stage2.gt"):
        for _ in range(5):
            extract_gt([MALFORMED["empty desc"]], sample_id=1, limiter=lim)
        assert len(caplog.records) == 2
        assert lim.flush_summary() == 3
        assert len(caplog.records) == 3 and "3 more malformed" in caplog.records[-1].getMessage()
        assert lim.flush_summary() == 0 and len(caplog.records) == 3


def _box(y: int, x: int) -> dict:
    return {"desc": f"{y},{x}", "bbox_2d": [x, y, x + 10, y + 10]}


def test_sorted_ordering_by_anchor():
    objs = [_box(400, 520), _box(80, 100), _box(650, 400)]
    assert [object_anchor(o) for o in order_objects(objs)] == [(80, 100), (400, 520), (650, 400)]


def test_sorted_ordering_poly_anchor_stable_and_malformed_last():
    poly = {"desc": "p", "poly": [50, 90, 10, 80, 90, 80]}  # anchor: min (y, x) = (80, 10)
    tie = _box(80, 10)
    bad = {"desc": "", "bbox_2d": [0, 0, 1, 1]}
    out = order_objects([bad, poly, _box(400, 0), tie])
    assert out == [poly, tie, _box(400, 0), bad]
    assert object_anchor(poly) == (80, 10)


def test_random_ordering_is_seeded_by_seed_and_base_idx():
    objs = [_box(y, 0) for y in range(20)]
    a = order_objects(objs, "random", seed=1, base_idx=7)
    assert a == order_objects(objs, "random", seed=1, base_idx=7)
    assert sorted(map(object_anchor, a)) == sorted(map(object_anchor, objs))
    assert a != order_objects(objs, "random", seed=1, base_idx=8)
    assert a != order_objects(objs, "random", seed=2, base_idx=7)
    with pytest.raises(ValueError):
        order_objects(objs, "shuffled")
