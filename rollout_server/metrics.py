"""Prometheus metrics of one rollout server (`GET /metrics`, text exposition format).

One `CollectorRegistry` per app (never the process-global one: `create_app` runs many times in one process).
HTTP series come from `prometheus-fastapi-instrumentator` (`http_requests_total` by handler, method and
status; `http_request_duration_seconds` and `http_request_duration_highr_seconds` latency histograms;
request and response sizes); this module adds the rollout series the instrumentator cannot see:

| series | type | labels | meaning |
|---|---|---|---|
| `rollmatch_infer_samples_total` | counter | | completions generated (request × `n`) |
| `rollmatch_infer_calls_in_flight` | gauge | | `/infer/` calls admitted and not yet answered |
| `rollmatch_infer_samples_in_flight` | gauge | | completions of admitted, unanswered `/infer/` calls (1) |
| `rollmatch_infer_disconnects_total` | counter | | `/infer/` calls whose client went away (aborted) |
| `rollmatch_prompt_tokens_total` | counter | | prompt tokens of answered requests |
| `rollmatch_generation_tokens_total` | counter | | generated tokens |
| `rollmatch_infer_batch_size` | histogram | | completions per `/infer/` call (the engine's batch) |
| `rollmatch_weight_syncs_total` | counter | mode, transport, outcome | syncs by outcome (2) |
| `rollmatch_weight_sync_bytes_total` | counter | mode, transport | tensor bytes of committed syncs |
| `rollmatch_weight_sync_seconds` | histogram | mode, transport | begin → commit of committed syncs |
| `rollmatch_weight_sync_staging_bytes` | gauge | where | bytes the last committed full sync staged (3) |
| `rollmatch_weight_version` | gauge | | weight version served |
| `rollmatch_health_status` | gauge | status | 1 for the current `/health` status, 0 for the others (4) |

(1) generating, or waiting behind a weight commit. (2) `committed`, `rejected`, `aborted`, `expired`,
`superseded`, `failed`. (3) before its commit, by `where`: `device` (GPU memory), `host` (pinned host memory
or /dev/shm files), `auto` when the vLLM workers chose; see `server.sync_staging`. (4) `ok`, `loading`,
`error`.

The two gauges that describe state (`weight_version`, `health_status`) are refreshed when scraped. Requests
queued INSIDE vLLM's scheduler are not a separate series: the engine runs with `disable_log_stats`, so its
scheduler stats are not collected; `rollmatch_infer_samples_in_flight` counts them with the running ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared_schemas.infer import InferResult

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus text exposition format."""

HEALTH_STATES = ("ok", "loading", "error")


class ServerMetrics:
    """The rollout series of one app, in its own registry (HTTP series are added by the app factory)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples = Counter("rollmatch_infer_samples", "Completions generated (request x n)", registry=r)
        self.calls_in_flight = Gauge(
            "rollmatch_infer_calls_in_flight", "/infer/ calls admitted and not yet answered", registry=r
        )
        self.samples_in_flight = Gauge(
            "rollmatch_infer_samples_in_flight", "Completions being generated now", registry=r
        )
        self.disconnects = Counter(
            "rollmatch_infer_disconnects",
            "/infer/ calls whose client went away (generation aborted)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rollmatch_prompt_tokens", "Prompt tokens of answered requests", registry=r
        )
        self.generation_tokens = Counter("rollmatch_generation_tokens", "Generated tokens", registry=r)
        self.batch_size = Histogram(
            "rollmatch_infer_batch_size",
            "Completions per /infer/ call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
            registry=r,
        )
        self.syncs = Counter(
            "rollmatch_weight_syncs", "Weight syncs by outcome", ["mode", "transport", "outcome"], registry=r
        )
        self.sync_bytes = Counter(
            "rollmatch_weight_sync_bytes",
            "Tensor bytes of committed syncs",
            ["mode", "transport"],
            registry=r,
        )
        self.sync_seconds = Histogram(
            "rollmatch_weight_sync_seconds",
            "Begin to commit of committed syncs, seconds",
            ["mode", "transport"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.sync_staging = Gauge(
            "rollmatch_weight_sync_staging_bytes",
            "Bytes the last committed full sync staged before its commit, by where they waited",
            ["where"],
            registry=r,
        )
        self.weight_version = Gauge("rollmatch_weight_version", "Weight version served", registry=r)
        self.health = Gauge(
            "rollmatch_health_status", "1 for the current /health status", ["status"], registry=r
        )

    def infer_done(self, results: Sequence[InferResult]) -> None:
        """Counts an answered `/infer/` call's completions and tokens."""
        completions = sum(len(r.choices) for r in results)
        self.samples.inc(completions)
        self.batch_size.observe(completions)
        self.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in results))
        self.generation_tokens.inc(sum(len(c.token_ids) for r in results for c in r.choices))

    def sync_finished(
        self,
        *,
        mode: str,
        transport: str,
        outcome: str,
        nbytes: int = 0,
        seconds: float | None = None,
        stages: Mapping[str, float] | None = None,
    ) -> None:
        """Counts one sync's end; committed syncs also add their bytes and duration, and full ones set the
        staging gauge from their `stages` (`staging_<where>_bytes`)."""
        self.syncs.labels(mode, transport, outcome).inc()
        if outcome == "committed":
            self.sync_bytes.labels(mode, transport).inc(nbytes)
            if seconds is not None:
                self.sync_seconds.labels(mode, transport).observe(seconds)
            if mode == "full" and stages:
                for where in ("device", "host", "auto"):
                    self.sync_staging.labels(where).set(stages.get(f"staging_{where}_bytes", 0.0))

    def render(self, *, status: str, weight_version: int) -> bytes:
        """The exposition text, with the state gauges set to `status` and `weight_version` first."""
        self.weight_version.set(weight_version)
        for state in HEALTH_STATES:
            self.health.labels(state).set(1.0 if state == status else 0.0)
        return generate_latest(self.registry)
