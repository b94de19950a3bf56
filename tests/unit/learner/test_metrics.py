"""Per-step metric aggregation (docs/ALGORITHM.md#metrics, §18; arithmetic of §20.12)."""

from __future__ import annotations

import math
import threading

import pytest

from learner.batching.packing import CarryBuffer
from learner.metrics import TIME_KEYS, StepMetrics, prf
from tests.unit.learner.segment_factory import sized_segment

WORKED_EXAMPLE = {  # §21: 1 sample, 3 GT, 2 valid preds (+2 invalid), 1 TP, 6 candidate pairs, 5 rejections
    "samples": 1,
    "parse_obj_total": 4,
    "parse_dropped_invalid": 2,
    "parse_truncated": 1,
    "gt_objects": 3,
    "gt_malformed": 0,
    "valid_pred_objects": 2,
    "matched": 1,
    "matched_for_supervision": 1,
    "fp": 1,
    "fn": 2,
    "fn_appended": 2,
    "gating_rejections": 5,
    "candidate_pairs": 6,
    "matched_maskiou_sum": 0.94,
    "matched_maskiou_count": 1,
    "samples_with_valid_pred": 1,
    "samples_with_match": 1,
    "fn_start_bumped": 1,
    "prefix_coord_targets_total": 4,
    "tail_ignored_tokens": 2,
    "append_tokens": 70,
}


def test_worked_example_rates_section_20_12() -> None:
    m = StepMetrics()
    m.add_rollout_counters(WORKED_EXAMPLE)
    out = m.finalize()
    assert out["rollout/gating_rejections"] == 5 and out["rollout/candidate_pairs"] == 6
    assert out["rollout/gating_rejection_rate"] == pytest.approx(0.8333, abs=1e-4)
    assert out["rollout/precision"] == pytest.approx(0.5)
    assert out["rollout/recall"] == pytest.approx(0.3333, abs=1e-4)
    assert out["rollout/f1"] == pytest.approx(0.4)
    assert out["rollout/gt_malformed"] == 0 and out["rollout/parse_dropped_invalid"] == 2
    assert out["rollout/parse_obj_valid_frac"] == pytest.approx(0.5)
    assert out["rollout/tail_ignore_frac"] == pytest.approx(2 / 70)
    assert out["rollout/prefix_coord_targets_per_matched"] == 4
    assert out["rollout/matched_maskiou_mean"] == pytest.approx(0.94)
    assert out["rollout/fn_start_bumped"] == 1 and out["rollout/parse_truncated_rate"] == 1
    assert "rollout/matched_maskiou_sum" not in out and "rollout/desc_exact_acc_on_matched" not in out


def test_prf_edge_cases() -> None:
    assert prf(0, 0, 0) == (0.0, 0.0, 0.0)
    assert prf(2, 2, 2) == (1.0, 1.0, 1.0)


def _run_ranks(metrics: list[StepMetrics]) -> list[dict[str, float]]:
    """Finalize several ranks concurrently through a fake all-reduce (threads + barrier).

    Each op ("sum", then "max") is called exactly once per rank per finalize.
    """
    barrier = threading.Barrier(len(metrics))
    slots: dict[str, list[list[float]]] = {"sum": [], "max": []}
    lock = threading.Lock()

    def reduce_fn(values: list[float], op: str) -> list[float]:
        with lock:
            slots[op].append(list(values))
        barrier.wait()
        cols = list(zip(*slots[op], strict=True))
        return [sum(c) for c in cols] if op == "sum" else [max(c) for c in cols]

    results: list[dict[str, float] | None] = [None] * len(metrics)

    def run(i: int) -> None:
        metrics[i].reduce_fn = reduce_fn
        results[i] = metrics[i].finalize()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(metrics))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def test_rates_come_from_global_sums_over_ranks() -> None:
    a, b = StepMetrics(), StepMetrics()
    a.add_rollout_counters(
        {"samples": 1, "valid_pred_objects": 1, "matched_for_supervision": 1, "gt_objects": 1}
    )
    b.add_rollout_counters(
        {"samples": 3, "valid_pred_objects": 3, "matched_for_supervision": 0, "gt_objects": 3}
    )
    a.add_time("time/forward_s", 1.0)
    a.add_time("time/forward_s", 0.5)  # summed over the rank's micro-steps
    b.add_time("time/forward_s", 2.0)  # ranks: max
    a.observe("rollout/prompt_len", [10, 20])
    b.observe("rollout/prompt_len", [30, 40, 50, 60])
    out_a, out_b = _run_ranks([a, b])
    for out in (out_a, out_b):
        assert out["rollout/precision"] == pytest.approx(0.25)  # not the mean of 1.0 and 0.0
        assert out["rollout/samples"] == 4 and out["train/samples_total"] == 4
        assert out["time/forward_s"] == pytest.approx(2.0)
        assert out["rollout/prompt_len_mean"] == pytest.approx(35.0)  # global mean
    assert out_a["rollout/prompt_len_p90"] == pytest.approx(19.0)  # percentiles stay rank-local
    assert out_b["rollout/prompt_len_p90"] == pytest.approx(57.0)


def test_loss_metrics_from_sums() -> None:
    m = StepMetrics()
    for micro in ({"ce": (6.0, 3), "coord": (2.0, 1, 2.0, 1)}, {"ce": (4.0, 7), "coord": (9.0, 3, 0.0, 0)}):
        s_ce, n_ce = micro["ce"]
        s_coord, n_coord, s_pref, n_pref = micro["coord"]
        m.add(
            {
                "loss/sum_ce": s_ce,
                "loss/count_ce": n_ce,
                "loss/sum_ce_eos": 1.0,
                "loss/count_ce_eos": 1,
                "loss/sum_coord": s_coord,
                "loss/count_coord": n_coord,
                "loss/sum_coord_prefix": s_pref,
                "loss/count_coord_prefix": n_pref,
                "loss/sum_coord_tail": s_coord - s_pref,
                "loss/count_coord_tail": n_coord - n_pref,
                "loss/sum_coord_softce": s_coord / 2,
                "loss/sum_coord_w1": s_coord / 4,
                "loss/sum_coord_gate": s_coord / 4,
                "loss/coord_nonfinite": 1,
                "train/micro_steps": 1,
            }
        )
    out = m.finalize()
    assert out["loss/ce"] == pytest.approx(1.0) and out["loss/coord"] == pytest.approx(11 / 4)
    assert out["loss/total"] == pytest.approx(1.0 + 11 / 4)
    assert out["loss/ce_eos"] == pytest.approx(1.0)
    assert out["loss/coord_prefix"] == pytest.approx(2.0) and out["loss/coord_tail"] == pytest.approx(3.0)
    assert out["loss/coord_softce"] == pytest.approx(11 / 8) and out["loss/coord_nonfinite"] == 2
    assert out["train/supervised_ce_tokens"] == 10 and out["train/supervised_coord_slots"] == 4
    assert out["train/micro_steps"] == 2


def test_packing_metrics_and_m_step_shape() -> None:
    buf = CarryBuffer(packing_length=10, packing_buffer=8, min_fill_ratio=0.9)
    buf.insert([sized_segment(n, rollout_step=s) for n, s in [(6, 0), (3, 1), (4, 2), (5, 2)]])
    m = StepMetrics()
    for step in (3, 3):
        _, stats = buf.take(global_step=step)
        m.add(stats.metric_values())
    m.add({"rollout/buffer_reuse": 1, "rollout/buffer_window_step0": 2, "rollout/buffer_completed_steps": 1})
    out = m.finalize()
    # packs: [6, 4] (fill 1.0, staleness 3, 1) then [3, 5] (fill 0.8, staleness 2, 1)
    assert out["packing/post_rollout_fill"] == pytest.approx(0.9)
    assert out["packing/post_rollout_selected_total_len"] == pytest.approx(9.0)
    assert out["packing/post_rollout_segments"] == pytest.approx(2.0)
    assert out["packing/underfilled_packs"] == 1 and out["packing/post_rollout_buffer"] == 0
    assert out["packing/segment_staleness_mean"] == pytest.approx(7 / 4)
    assert out["packing/segment_staleness_max"] == 3
    assert out["packing/avg_segment_len_ema"] > 0
    # an M-step carries no rollout-quality metric and zero rollout timers
    assert out["rollout/buffer_reuse"] == 1 and "rollout/precision" not in out
    assert all(out[k] == 0.0 for k in TIME_KEYS)


def test_unknown_keys_raise_and_extra_keys_register() -> None:
    m = StepMetrics()
    with pytest.raises(KeyError, match="not registered"):
        m.add({"rollout/made_up": 1})
    with pytest.raises(KeyError):
        m.observe("rollout/made_up_len", [1])
    with pytest.raises(KeyError):
        m.add_time("time/nap_s", 1)
    g = StepMetrics(extra_sum_keys=["grpo/reward_sum"])
    g.add({"grpo/reward_sum": 2.5})
    assert g.finalize()["grpo/reward_sum"] == 2.5


def test_samples_seen_is_cumulative_and_timer_records() -> None:
    m = StepMetrics()
    for _ in range(3):
        m.add_rollout_counters({"samples": 2})
        with m.timer("time/backward_s"):
            pass
        out = m.finalize()
    assert out["train/samples_seen"] == 6 and out["train/samples_total"] == 2
    assert out["time/backward_s"] >= 0.0


def test_generation_distribution_and_throughput() -> None:
    m = StepMetrics()
    m.add_rollout_counters({"samples": 4})
    m.observe("rollout/gen_new_tokens", [10, 20, 30, 100])
    m.add_time("time/rollout_generate_s", 2.0)
    m.add_rollout_counters({"desc_pairs_total": 4, "desc_exact_correct": 3})
    out = m.finalize()
    assert out["rollout/gen_new_tokens_total"] == 160 and out["rollout/gen_new_tokens_mean"] == 40
    assert out["rollout/gen_new_tokens_p99"] == pytest.approx(97.9)
    assert out["rollout/gen_tokens_per_s"] == pytest.approx(80.0)
    assert out["rollout/desc_exact_acc_on_matched"] == pytest.approx(0.75)


def test_loss_sums_names_are_registered() -> None:
    import torch

    from learner.batching.packing import pack_segments
    from learner.stage2.losses import CoordLossConfig, step_loss_sums
    from tests.unit.learner.segment_factory import COORD_IDS, EOT, VOCAB_SIZE, coord, make_segment

    batch = pack_segments([make_segment([7], [coord(4)], [9, coord(8)], prefix_targets={0: 5})])
    logits = torch.zeros(1, batch.input_ids.shape[1], VOCAB_SIZE)
    sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
    m = StepMetrics()
    m.add(sums.metric_sums())
    out = m.finalize()
    assert out["train/supervised_coord_slots"] == 2 and out["train/supervised_ce_tokens"] == 2
    assert out["loss/ce"] == pytest.approx(float(torch.log(torch.tensor(float(VOCAB_SIZE)))), rel=1e-5)
    assert out["loss/coord_gate"] == pytest.approx(math.log(VOCAB_SIZE / 1000), rel=1e-5)  # uniform logits
    assert out["loss/coord_softce"] == pytest.approx(math.log(1000), rel=1e-5)


def test_perf_sums_are_global_and_only_when_counted() -> None:
    """`perf/*` (learner.flops) add up over micro-steps and ranks; a step that trained nothing has none."""
    m = StepMetrics(reduce_fn=lambda values, op: [2 * v for v in values] if op == "sum" else values)
    for _ in range(2):
        m.add({"perf/tokens": 100, "perf/model_flops": 1e12, "perf/attn_flops": 1e11})
    out = m.finalize()
    assert out["perf/tokens"] == 400 and out["perf/model_flops"] == 4e12 and out["perf/attn_flops"] == 4e11
    assert not any(k.startswith("perf/") for k in StepMetrics().finalize())
