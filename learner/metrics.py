"""Per-optimizer-step metric aggregation (docs/ALGORITHM.md#metrics, #evaluation).

A :class:`StepMetrics` collects everything one optimizer step produces on one rank: summed counters
(``rollout/*`` per-sample counters, loss sums and counts, pack telemetry), per-step maxima, rank-local
gauges and length distributions. :meth:`StepMetrics.finalize` reduces the counters over DP ranks
through the caller's ``reduce_fn`` (the trainer passes an all-reduce; this module never touches
``torch.distributed``), computes every rate and mean from the GLOBAL sums, adds rank-local percentiles,
and returns one flat ``{tag: value}`` dict for the step.

Only registered keys are accepted, so that every rank reduces the same vector in the same order; an
unknown key is a programming error and raises at :meth:`StepMetrics.add` time. Register extra keys
with ``extra_sum_keys`` (e.g. for GRPO).

Reduction rules: counters are summed over ranks; ``time/*`` and the ``*_max`` keys take the maximum
over ranks (a step lasts as long as its slowest rank); gauges (``post_rollout_buffer``,
``avg_segment_len_ema``, ``rollout/buffer_*``, ``decode_*``) and percentiles stay rank-local.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import numpy as np

__all__ = [
    "DISTRIBUTIONS",
    "GAUGE_KEYS",
    "MAX_KEYS",
    "ROLLOUT_COUNTS",
    "SUM_KEYS",
    "ReduceFn",
    "StepMetrics",
    "prf",
]

ReduceFn = Callable[[list[float], Literal["sum", "max"]], list[float]]
"""All-reduce of a flat float vector over DP ranks with the given op; every rank must call it."""

ROLLOUT_COUNTS: tuple[str, ...] = (
    "samples",
    "parse_obj_total",
    "parse_dropped_invalid",
    "parse_truncated",
    "parse_fallback",
    "parse_cut_fallback",
    "finish_length",
    "repeat_terminated",
    "gt_objects",
    "gt_malformed",
    "valid_pred_objects",
    "matched",
    "matched_for_supervision",
    "excluded_from_supervision",
    "fp",
    "fn",
    "fn_appended",
    "gating_rejections",
    "candidate_pairs",
    "matched_maskiou_sum",
    "matched_maskiou_count",
    "samples_with_valid_pred",
    "samples_with_match",
    "fn_start_bumped",
    "reorder_moved",
    "prompt_mismatch_dropped",
    "oversize_dropped",
    "prefix_coord_targets_total",
    "tail_ignored_tokens",
    "append_tokens",
    "desc_pairs_total",
    "desc_exact_correct",
    "desc_sem_correct",
    "desc_sem_sim_sum",
)
"""Per-sample counters (names as in ``SegmentMeta.counters``, without the ``rollout/`` prefix)."""

_HIDDEN_ROLLOUT = {
    "matched_maskiou_sum",
    "samples_with_valid_pred",
    "samples_with_match",
    "tail_ignored_tokens",
    "append_tokens",
    "desc_exact_correct",
    "desc_sem_correct",
    "desc_sem_sim_sum",
}

_LOSS_SUMS = (
    "sum_ce",
    "count_ce",
    "sum_ce_eos",
    "count_ce_eos",
    "sum_coord",
    "count_coord",
    "sum_coord_prefix",
    "count_coord_prefix",
    "sum_coord_tail",
    "count_coord_tail",
    "sum_coord_softce",
    "sum_coord_w1",
    "sum_coord_gate",
    "coord_nonfinite",
    "sum_fp_unlikelihood",
    "sum_fp_unlikelihood_weighted",
    "count_fp_unlikelihood",
)
"""Loss sums and counts (as produced by ``LossSums.metric_sums``), under ``loss/``."""

_PACKING_SUMS = (
    "packs",
    "sum_fill",
    "sum_selected_total_len",
    "sum_segments",
    "underfilled_packs",
    "sum_staleness",
    "count_staleness",
)

_STALENESS_SUMS = ("staleness_sum", "staleness_count", "prefetched", "regenerated")
"""Overlapped rollouts (`rollout.async`): per trained rollout, optimizer steps between its weights and the
update (summed and counted), rollouts that came from a background request, and stale ones regenerated."""

_PERF_SUMS = ("tokens", "model_flops", "attn_flops")
"""Language-model tokens, model FLOPs and attention FLOPs of the step's micro-batches (`learner.flops`),
emitted as global sums under ``perf/``; the trainer derives tokens/s and MFU from them."""

TIME_KEYS: tuple[str, ...] = tuple(
    f"time/{k}"
    for k in (
        "rollout_generate_s",
        "weight_sync_s",
        "weight_sync_agree_s",
        "offload_s",
        "rollout_parse_match_s",
        "teacher_encode_s",
        "post_rollout_pack_s",
        "mask_build_s",
        "forward_s",
        "backward_s",
        "rollout_wait_s",
    )
)

DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "rollout/prompt_len": ("mean", "p90"),
    "rollout/rollout_len": ("mean", "p90"),
    "rollout/prefix_len": ("mean",),
    "rollout/append_len": ("mean", "p90"),
    "rollout/train_len": ("mean", "p90"),
    "rollout/encoded_len": ("mean", "p90"),
    "rollout/gen_new_tokens": ("total", "mean", "p90", "p99"),
}
"""Observed value lists: ``mean``/``total`` from global sums, ``pNN`` rank-local."""

SUM_KEYS: frozenset[str] = frozenset(
    [f"rollout/{k}" for k in ROLLOUT_COUNTS]
    + [f"loss/{k}" for k in _LOSS_SUMS]
    + [f"packing/{k}" for k in _PACKING_SUMS]
    + ["train/micro_steps"]
    + [f"perf/{k}" for k in _PERF_SUMS]
    + [f"rollout/{k}" for k in _STALENESS_SUMS]
)
MAX_KEYS: frozenset[str] = frozenset([*TIME_KEYS, "packing/segment_staleness_max", "rollout/staleness_max"])
GAUGE_KEYS: frozenset[str] = frozenset(
    [
        "packing/post_rollout_buffer",
        "packing/avg_segment_len_ema",
        "rollout/buffer_reuse",
        "rollout/buffer_window_step0",
        "rollout/buffer_completed_steps",
        "rollout/decode_greedy",
        "rollout/decode_beam",
    ]
)


def _ratio(num: float, den: float) -> float:
    return num / max(den, 1.0)


def prf(matched: float, pred: float, gt: float) -> tuple[float, float, float]:
    """Object-level micro precision, recall, F1 from totals (§18).

    ``precision = matched / max(pred, 1)``, ``recall = matched / max(gt, 1)``,
    ``f1 = 2PR / (P + R)`` or 0 when ``P + R = 0``.
    """
    p, r = _ratio(matched, pred), _ratio(matched, gt)
    return p, r, (2 * p * r / (p + r) if p + r > 0 else 0.0)


class StepMetrics:
    """Accumulates one optimizer step's metrics on one rank; :meth:`finalize` emits and resets.

    ``train/samples_seen`` is cumulative over the object's life (all finalized steps).
    """

    def __init__(self, *, reduce_fn: ReduceFn | None = None, extra_sum_keys: Iterable[str] = ()) -> None:
        self.reduce_fn = reduce_fn
        self._extra_keys = frozenset(extra_sum_keys)
        self._sum_keys = (
            SUM_KEYS
            | frozenset(extra_sum_keys)
            | {f"{d}_sum" for d in DISTRIBUTIONS}
            | {f"{d}_count" for d in DISTRIBUTIONS}
        )
        self._samples_seen = 0.0
        self.reset()

    def reset(self) -> None:
        """Forget this step's values (cumulative totals are kept)."""
        self._sums: dict[str, float] = {}
        self._maxes: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._samples: dict[str, list[float]] = {}

    def add(self, values: Mapping[str, float]) -> None:
        """Merge values: counters add up, ``time/*`` and ``*_max`` keep their max, gauges the latest.

        Raises:
            KeyError: a key that is not registered (it could not be reduced consistently over ranks).
        """
        for key, value in values.items():
            v = float(value)
            if key in self._sum_keys:
                self._sums[key] = self._sums.get(key, 0.0) + v
            elif key in TIME_KEYS:
                # Times are summed over the step on this rank, then maxed over ranks.
                self._maxes[key] = self._maxes.get(key, 0.0) + v
            elif key in MAX_KEYS:
                self._maxes[key] = max(self._maxes.get(key, -math.inf), v)
            elif key in GAUGE_KEYS:
                self._gauges[key] = v
            else:
                raise KeyError(
                    f"metric {key!r} is not registered in learner.metrics (SUM_KEYS / MAX_KEYS / "
                    "GAUGE_KEYS); register it or pass it via StepMetrics(extra_sum_keys=...)"
                )

    def add_rollout_counters(self, counters: Mapping[str, float]) -> None:
        """Add per-sample counters named without the ``rollout/`` prefix (``SegmentMeta.counters``)."""
        self.add({f"rollout/{k}": v for k, v in counters.items()})

    def observe(self, name: str, values: Iterable[float]) -> None:
        """Record values of a length distribution (one of :data:`DISTRIBUTIONS`)."""
        if name not in DISTRIBUTIONS:
            raise KeyError(f"distribution {name!r} is not one of {sorted(DISTRIBUTIONS)}")
        vals = [float(v) for v in values]
        self._samples.setdefault(name, []).extend(vals)
        self.add({f"{name}_sum": sum(vals), f"{name}_count": float(len(vals))})

    def add_time(self, key: str, seconds: float) -> None:
        """Add seconds to a ``time/*`` key (e.g. ``"time/forward_s"``)."""
        if key not in TIME_KEYS:
            raise KeyError(f"timer {key!r} is not one of {list(TIME_KEYS)}")
        self.add({key: seconds})

    @contextmanager
    def timer(self, key: str) -> Iterator[None]:
        """Context manager adding its wall-clock duration to ``key``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(key, time.perf_counter() - start)

    def _reduced(self) -> tuple[dict[str, float], dict[str, float]]:
        sum_keys = sorted(self._sum_keys)
        max_keys = sorted(MAX_KEYS)
        sums = [self._sums.get(k, 0.0) for k in sum_keys]
        # -inf never leaves a rank: an unset max is 0 (timers, staleness of a step without packs).
        maxes = [self._maxes.get(k, 0.0) for k in max_keys]
        if self.reduce_fn is not None:
            sums = list(self.reduce_fn(sums, "sum"))
            maxes = list(self.reduce_fn(maxes, "max"))
        return dict(zip(sum_keys, sums, strict=True)), dict(zip(max_keys, maxes, strict=True))

    def finalize(self) -> dict[str, float]:
        """Reduce over ranks (when a ``reduce_fn`` is set), derive rates, return the step's dict, reset.

        Every rank must call it (the reduction is collective); the values are global on every rank
        except percentiles and gauges.
        """
        s, mx = self._reduced()
        out: dict[str, float] = dict(mx)
        out.update(self._loss(s))
        if s["rollout/samples"] > 0:
            out.update(self._rollout(s))
        out.update(self._distributions(s))
        if s["packing/packs"] > 0:
            out.update(self._packing(s))
        else:
            out.pop("packing/segment_staleness_max", None)
        out.update(self._gauges)
        out.update(self._staleness(s, out))
        if "rollout/gen_new_tokens_total" in out and mx["time/rollout_generate_s"] > 0:
            out["rollout/gen_tokens_per_s"] = (
                out["rollout/gen_new_tokens_total"] / mx["time/rollout_generate_s"]
            )
        self._samples_seen += s["rollout/samples"]
        out["train/samples_total"] = s["rollout/samples"]
        out["train/samples_seen"] = self._samples_seen
        out["train/micro_steps"] = s["train/micro_steps"]
        out["train/supervised_ce_tokens"] = s["loss/count_ce"]
        out["train/supervised_coord_slots"] = s["loss/count_coord"]
        if s["loss/count_fp_unlikelihood"] > 0:
            out["train/fp_tokens_penalized"] = s["loss/count_fp_unlikelihood"]
        if s["perf/tokens"] > 0:
            out.update({f"perf/{k}": s[f"perf/{k}"] for k in _PERF_SUMS})
        for key in self._extra_keys:
            out[key] = s[key]
        self.reset()
        return out

    @staticmethod
    def _staleness(s: Mapping[str, float], out: dict[str, float]) -> dict[str, float]:
        """`rollout/staleness_{mean,max}` (steps with rollouts only), `rollout/{prefetched,regenerated}`."""
        if s["rollout/staleness_count"] <= 0:
            out.pop("rollout/staleness_max", None)
            return {}
        return {
            "rollout/staleness_mean": s["rollout/staleness_sum"] / s["rollout/staleness_count"],
            "rollout/prefetched": s["rollout/prefetched"],
            "rollout/regenerated": s["rollout/regenerated"],
        }

    @staticmethod
    def _loss(s: Mapping[str, float]) -> dict[str, float]:
        n_ce, n_coord, n_fp = s["loss/count_ce"], s["loss/count_coord"], s["loss/count_fp_unlikelihood"]
        ce, coord = _ratio(s["loss/sum_ce"], n_ce), _ratio(s["loss/sum_coord"], n_coord)
        # The false-positive unlikelihood (§13.5) is reported only on steps that penalized a token.
        fp = {"loss/fp_unlikelihood": _ratio(s["loss/sum_fp_unlikelihood"], n_fp)} if n_fp > 0 else {}
        return fp | {
            "loss/total": ce + coord + _ratio(s["loss/sum_fp_unlikelihood_weighted"], n_fp),
            "loss/ce": ce,
            "loss/ce_eos": _ratio(s["loss/sum_ce_eos"], s["loss/count_ce_eos"]),
            "loss/coord": coord,
            "loss/coord_prefix": _ratio(s["loss/sum_coord_prefix"], s["loss/count_coord_prefix"]),
            "loss/coord_tail": _ratio(s["loss/sum_coord_tail"], s["loss/count_coord_tail"]),
            "loss/coord_softce": _ratio(s["loss/sum_coord_softce"], n_coord),
            "loss/coord_w1": _ratio(s["loss/sum_coord_w1"], n_coord),
            "loss/coord_gate": _ratio(s["loss/sum_coord_gate"], n_coord),
            "loss/coord_nonfinite": s["loss/coord_nonfinite"],
        }

    @staticmethod
    def _rollout(s: Mapping[str, float]) -> dict[str, float]:
        c = {k: s[f"rollout/{k}"] for k in ROLLOUT_COUNTS}
        n = c["samples"]
        out = {f"rollout/{k}": v for k, v in c.items() if k not in _HIDDEN_ROLLOUT}
        precision, recall, f1 = prf(c["matched_for_supervision"], c["valid_pred_objects"], c["gt_objects"])
        out |= {
            "rollout/parse_obj_valid_frac": _ratio(c["valid_pred_objects"], c["parse_obj_total"]),
            "rollout/parse_truncated_rate": _ratio(c["parse_truncated"], n),
            "rollout/excluded_rate": _ratio(c["excluded_from_supervision"], c["matched"]),
            "rollout/precision": precision,
            "rollout/recall": recall,
            "rollout/f1": f1,
            "rollout/gt_per_sample": _ratio(c["gt_objects"], n),
            "rollout/pred_per_sample": _ratio(c["valid_pred_objects"], n),
            "rollout/fp_per_sample": _ratio(c["fp"], n),
            "rollout/fn_per_sample": _ratio(c["fn"], n),
            "rollout/gating_rejection_rate": _ratio(c["gating_rejections"], c["candidate_pairs"]),
            "rollout/matched_maskiou_mean": _ratio(c["matched_maskiou_sum"], c["matched_maskiou_count"]),
            "rollout/sample_valid_pred_rate": _ratio(c["samples_with_valid_pred"], n),
            "rollout/sample_any_match_rate": _ratio(c["samples_with_match"], n),
            "rollout/prefix_coord_targets_per_matched": _ratio(
                c["prefix_coord_targets_total"], c["matched_for_supervision"]
            ),
            "rollout/tail_ignore_frac": _ratio(c["tail_ignored_tokens"], c["append_tokens"]),
        }
        if c["desc_pairs_total"] > 0:
            out |= {
                "rollout/desc_exact_acc_on_matched": _ratio(c["desc_exact_correct"], c["desc_pairs_total"]),
                "rollout/desc_sem_acc_on_matched": _ratio(c["desc_sem_correct"], c["desc_pairs_total"]),
                "rollout/desc_sem_sim_mean": _ratio(c["desc_sem_sim_sum"], c["desc_pairs_total"]),
            }
        else:
            out.pop("rollout/desc_pairs_total")
        return out

    def _distributions(self, s: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, stats in DISTRIBUTIONS.items():
            count = s[f"{name}_count"]
            if count <= 0:
                continue
            local = self._samples.get(name, [])
            for stat in stats:
                if stat == "mean":
                    out[f"{name}_mean"] = s[f"{name}_sum"] / count
                elif stat == "total":
                    out[f"{name}_total"] = s[f"{name}_sum"]
                elif local:
                    out[f"{name}_{stat}"] = float(np.percentile(local, float(stat[1:])))
        return out

    @staticmethod
    def _packing(s: Mapping[str, float]) -> dict[str, float]:
        packs = s["packing/packs"]
        return {
            "packing/post_rollout_fill": s["packing/sum_fill"] / packs,
            "packing/post_rollout_selected_total_len": s["packing/sum_selected_total_len"] / packs,
            "packing/post_rollout_segments": s["packing/sum_segments"] / packs,
            "packing/underfilled_packs": s["packing/underfilled_packs"],
            "packing/segment_staleness_mean": _ratio(
                s["packing/sum_staleness"], s["packing/count_staleness"]
            ),
        }
