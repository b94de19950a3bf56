"""Dataloader repeater and E/M rollout buffer (docs/ALGORITHM.md#rollout-buffer, tests of §20.11)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from learner.batching.packing import pack_segments
from learner.stage2.rollout_reuse import (
    BufferConsistencyError,
    RepeatingLoader,
    RolloutBuffer,
    RolloutBufferConfig,
    TaggedBatch,
    copy_prepared,
    fingerprint,
    repeated_len,
)
from tests.unit.learner.segment_factory import sized_segment


def test_repeater_spec_example() -> None:
    loader = RepeatingLoader(["A", "B", "C", "D"], gas=3, m_steps=2)
    out = list(loader)
    assert [t.batch for t in out] == ["A", "B", "C", "A", "B", "C", "D"]
    assert [(t.window_id, t.repetition) for t in out] == [(0, 0)] * 3 + [(0, 1)] * 3 + [(1, 0)]
    assert len(loader) == 7
    assert repeated_len(7, 3, 2) == 13
    assert (
        len(RepeatingLoader(list(range(7)), gas=3, m_steps=2))
        == 13
        == len(list(RepeatingLoader(list(range(7)), 3, 2)))
    )


def test_repeater_streams_first_pass_and_continues_window_ids() -> None:
    pulled: list[int] = []

    class Source:
        def __iter__(self):
            for i in range(4):
                pulled.append(i)
                yield i

        def __len__(self) -> int:
            return 4

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    src = Source()
    loader = RepeatingLoader(src, gas=2, m_steps=3)
    it = iter(loader)
    first = next(it)
    assert first.batch == 0 and pulled == [0]  # streamed, not read ahead
    rest = list(it)
    assert [t.batch for t in [first, *rest]] == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    second_epoch = list(loader)
    assert second_epoch[0].window_id == 2  # ids never collide across epochs
    loader.set_epoch(5)  # delegated to the inner loader
    assert src.epoch == 5
    batch, window_id, repetition = second_epoch[-1]
    assert (batch, window_id, repetition) == (3, 3, 2)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), gas=st.integers(1, 6), m=st.integers(1, 4))
def test_repeater_never_skips_or_reorders(n: int, gas: int, m: int) -> None:
    loader = RepeatingLoader(list(range(n)), gas=gas, m_steps=m)
    out = list(loader)
    assert len(out) == len(loader) == repeated_len(n, gas, m)
    first_pass = [t.batch for t in out if t.repetition == 0]
    assert first_pass == list(range(n))  # every sample once, in order, on the first pass
    for t in out:  # each window replays exactly its own batches in order
        window = [u.batch for u in out if u.window_id == t.window_id and u.repetition == t.repetition]
        assert window == [b for b in first_pass if b // gas == t.window_id]
    full_windows = n // gas
    assert sum(1 for t in out if t.repetition > 0) == full_windows * gas * (m - 1)


def _raw(window: int, rep: int, sample_ids: list[int]) -> TaggedBatch:
    return TaggedBatch([{"base_idx": s, "sample_id": (1 << 32) | s} for s in sample_ids], window, rep)


def _step_raws(window: int, rep: int, gas: int = 2) -> list[TaggedBatch]:
    return [_raw(window, rep, [10 * window + 2 * m, 10 * window + 2 * m + 1]) for m in range(gas)]


class Builder:
    """Fresh-step planner stand-in that records its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, raws):
        self.calls += 1
        prepared = [
            {
                "batch": pack_segments([sized_segment(5, sample_id=s["sample_id"]) for s in raw]),
                "metrics": {"x": 1.0},
            }
            for raw in raws
        ]
        return prepared, 11 * self.calls, 3


def test_fingerprint_is_sha1_of_ids() -> None:
    raw = [{"base_idx": 3, "sample_id": 7, "messages": []}, {"base_idx": 4, "sample_id": 8}]
    assert fingerprint(raw) == hashlib.sha1(json.dumps([[3, 7], [4, 8]]).encode()).hexdigest()


def test_m_step_reuses_without_building_and_copies() -> None:
    buf, build = RolloutBuffer(m_steps=3, gas=2), Builder()
    e = buf.prepare_step(_step_raws(0, 0), build, global_step=10)
    assert build.calls == 1 and e.decision.fresh_rollouts and e.metrics()["rollout/buffer_reuse"] == 0.0
    assert (e.n_ce, e.n_coord) == (11, 3)
    e.prepared[0]["batch"].meta[0].pop("sample_id")  # the E-step's own batch is not the cache either
    m1 = buf.prepare_step(_step_raws(0, 1), build, global_step=11)
    assert build.calls == 1 and m1.decision.reuse and not m1.decision.fresh_rollouts
    assert m1.metrics() == {
        "rollout/buffer_reuse": 1.0,
        "rollout/buffer_window_step0": 10.0,
        "rollout/buffer_completed_steps": 1.0,
    }
    assert (m1.n_ce, m1.n_coord) == (11, 3)
    # popping meta keys / batch keys from a returned batch leaves the cache intact
    m1.prepared[0]["batch"].meta[0].pop("sample_id")
    m1.prepared[0].pop("metrics")
    m2 = buf.prepare_step(_step_raws(0, 2), build, global_step=12)
    assert build.calls == 1
    assert m2.prepared[0]["batch"].meta[0]["sample_id"] == (1 << 32) | 0
    assert m2.prepared[0]["metrics"] == {"x": 1.0}
    # tensors are shared, never copied
    assert m2.prepared[1]["batch"].input_ids is m1.prepared[1]["batch"].input_ids
    assert buf.cached_window is None  # cleared after the last repetition
    buf.prepare_step(_step_raws(1, 0), build, global_step=13)
    assert build.calls == 2


def test_an_m_step_reuses_the_false_positive_count_too() -> None:
    """A planner that also counts penalized false-positive tokens (§13.5): the M-step normalizes by them."""

    def build_with_fp(raws):
        prepared, n_ce, n_coord = Builder()(raws)
        return prepared, n_ce, n_coord, 7

    buf = RolloutBuffer(m_steps=2, gas=2)
    e = buf.prepare_step(_step_raws(0, 0), build_with_fp, global_step=0)
    m1 = buf.prepare_step(_step_raws(0, 1), build_with_fp, global_step=1)
    assert e.n_fp == 7 and m1.decision.reuse and m1.n_fp == 7


def test_fingerprint_divergence_raises() -> None:
    buf, build = RolloutBuffer(m_steps=2, gas=2), Builder()
    buf.prepare_step(_step_raws(0, 0), build, global_step=0)
    bad = [_step_raws(0, 1)[0], _raw(0, 1, [99, 98])]
    with pytest.raises(BufferConsistencyError, match="fingerprint"):
        buf.prepare_step(bad, build, global_step=1)
    assert build.calls == 1


def test_partial_window_is_not_reused() -> None:
    buf, build = RolloutBuffer(m_steps=3, gas=2), Builder()
    decision = buf.begin_step([_raw(4, 0, [1, 2])])
    assert decision.partial and decision.fresh_rollouts and not decision.cache
    step = buf.prepare_step([_raw(4, 0, [1, 2])], build, global_step=0)
    assert build.calls == 1 and buf.cached_window is None and step.decision.partial


def test_eval_mode_and_disabled_bypass() -> None:
    buf, build = RolloutBuffer(m_steps=2, gas=2), Builder()
    buf.prepare_step(_step_raws(0, 0), build, global_step=0)
    d = buf.begin_step(_step_raws(0, 1), training=False)
    assert d.fresh_rollouts and not d.cache
    buf.prepare_step(_step_raws(0, 1), build, global_step=1, training=False)
    assert build.calls == 2
    off, build_off = RolloutBuffer(m_steps=4, gas=2, enabled=False), Builder()
    for rep in range(3):
        off.prepare_step(_step_raws(0, rep), build_off, global_step=rep)
    assert build_off.calls == 3 and off.cached_window is None
    single = RolloutBuffer(m_steps=1, gas=2)
    assert not single.enabled


def test_resume_without_cache_runs_e_step() -> None:
    buf, build = RolloutBuffer(m_steps=3, gas=2), Builder()
    step = buf.prepare_step(_step_raws(5, 1), build, global_step=40)
    assert build.calls == 1 and step.decision.fresh_rollouts and step.decision.cache
    buf.prepare_step(_step_raws(5, 2), build, global_step=41)
    assert build.calls == 1  # the rebuilt cache serves the remaining repetition


def test_mixed_tags_raise() -> None:
    buf = RolloutBuffer(m_steps=2, gas=2)
    with pytest.raises(BufferConsistencyError, match="gradient_accumulation_steps"):
        buf.begin_step([_raw(0, 0, [1]), _raw(1, 0, [2])])


def test_end_to_end_with_repeater() -> None:
    samples = [[{"base_idx": i, "sample_id": i}] for i in range(5)]
    loader = iter(RepeatingLoader(samples, gas=2, m_steps=2))
    buf, build = RolloutBuffer(m_steps=2, gas=2), Builder()
    kinds = []
    for step in range(5):
        raws = [r for _, r in zip(range(2), loader, strict=False)]
        kinds.append("M" if buf.prepare_step(raws, build, global_step=step).decision.reuse else "E")
    assert kinds == ["E", "M", "E", "M", "E"] and build.calls == 3


def test_copy_prepared_containers() -> None:
    t = torch.zeros(2)
    obj = {"a": [{"k": 1}], "t": t, "tup": (t, [1])}
    c = copy_prepared(obj)
    assert c == {"a": [{"k": 1}], "t": t, "tup": (t, [1])}
    assert (
        c["a"] is not obj["a"]
        and c["a"][0] is not obj["a"][0]
        and c["t"] is t
        and c["tup"][1] is not obj["tup"][1]
    )


def test_config() -> None:
    assert RolloutBufferConfig().m_steps == 1 and not RolloutBufferConfig().enabled
    with pytest.raises(ValidationError):
        RolloutBufferConfig(m_steps=0)
    buf = RolloutBuffer.from_config(RolloutBufferConfig(enabled=True, m_steps=4), gas=3)
    assert buf.enabled and buf.m_steps == 4 and buf.gas == 3
