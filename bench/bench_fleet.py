"""The rollout half of the "N + 1" bench: one `/infer/` call of image rollouts over 1 vs N HF-backend servers.

Written for a 4-GPU machine (`--servers 3`: the learner on GPU 0, one HF-backend rollout server on each of
GPUs 1..3, the 3+1 layout of `configs/server_3v1_template.yaml`); ran on 4 x H200 on 2026-11-26 (figures in
`bench/RESULTS.md`, "the 3 + 1 topology"). `--cpu-check` runs it with the servers on this host's CPU (tiny
Qwen3-VL).

    GPU (4 GPUs, ~1.5 min): python bench/bench_fleet.py --servers 3 --model vlm-2b --identity-tokens 32 \
                                --tokens 64 --repeats 3 --out fleet.jsonl
    CPU check (~1 min):    python bench/bench_fleet.py --cpu-check --servers 2 --model tiny-vlm

Topology: this process is the learner (it builds the model on `cuda:0`, or the CPU, and then only sends
requests); server k runs `python -m rollout_server` (HF backend, bf16) with `CUDA_VISIBLE_DEVICES` =
`--server-gpus`[k] (default k + 1). Every server loads the SAME saved weights (`--model`: `vlm-2b` = a
random-init model of Qwen3-VL-2B-Instruct's shapes, `bench/_vlm.py`; `tiny-vlm` = the tiny Qwen3-VL, CPU). The
requests are the trainer's own: the image demo's records (`learner.demo_data.images`, 192x192 PNGs, the demo's
prompts of `configs/demo_vlm_cpu.yaml`) loaded by `learner.trainers.build.load_samples`, turned into the
step's one `InferBatch` by `StepPlanner.step_batch` (per-request §5.3 seeds, the `rollout.decoding` request
config), and sent by `ServerRolloutSource.infer` (built by `ServerRolloutSource.from_config`): ordered
chunking, one contiguous chunk of ceil(B / N) rows per server, all chunks concurrent.

Workload size: B = N x the HF engine's decode batch (`server.hf.batch_size`, 8 here; the engine decodes a
call's rows in left-padded batches of that many, one after another). So ONE server runs N decode rounds and N
servers one round each: the regime where a step has more rollouts than one engine holds at once, which is
where more servers should pay. Each server's chunk is then exactly one of the one-server run's decode batches
(same rows, same order), so the identity check compares like with like.

Measures, one JSON line each (stdout, and appended to `--out`):

1. `fleet_identity`: the step batch (sampled, temperature 1, `--identity-tokens` new tokens, EOS allowed)
   against server 0 alone and against all N servers: the token ids must be identical row for row (`identical`,
   `rows`, `rows_differing`; `distinct_rows` shows that sampling really ran), every server on the same weight
   version; `one_server_repeat_identical` (server 0 twice) tells an engine that is not deterministic from a
   chunking that changes tokens.
2. `fleet_throughput`: generated tokens per second of the same batch with `ignore_eos` (every row exactly
   `--tokens` new tokens: random weights never stop, and a fixed length makes 1 and N servers do the same
   work), 1 server vs N: a warm-up call each, then best of `--repeats`; the ratio next to its bound N (the
   ideal; the issue's target is >= 2.6 for N = 3).
3. `fleet_kill`: the same kind of call (longer rows) over the N servers; once server `--kill-server` (default
   the middle one) has the call in flight, its process group gets SIGKILL. The documented policy
   (docs/RUNBOOK.md "A server died ..."; `ServerRolloutSource`'s retry policy): the run stops with
   `InferFailed` naming that server's URL, after one retry on a fresh connection (refused: no split), within
   `rollout.infer_timeout_s`. The call waits for every chunk before it raises, so the error comes once the
   surviving servers have finished theirs. Reported: seconds from the kill to the error, the error text,
   whether it names the dead server (and no other), whether it came within the timeout, and that nothing hung
   (a wait of timeout + 30 s guards it).

Every wait is bounded: server start-up (`--start-timeout-s`), each HTTP call (`rollout.timeout_s` /
`--infer-timeout-s`), the kill check's wait, and the whole run (`--deadline-s`: the run is interrupted and its
servers stopped; a watchdog kills their process groups and exits 124 if even that hangs). Servers are stopped
(SIGTERM, then SIGKILL) when the run ends, whatever happens.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts", REPO / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

DEMO_CONFIG = REPO / "configs" / "demo_vlm_cpu.yaml"


class BenchDeadline(Exception):
    """`--deadline-s` ran out."""


def _server_children() -> dict[str, int]:
    """`--config` path → pid of each child process of this one that runs `python -m rollout_server`
    (`bench_server.running` keeps its Popen to itself); each leads its own process group."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and "rollout_server" in argv and "--config" in argv[:-1]:
            found[argv[argv.index("--config") + 1]] = int(entry)
    return found


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watchdog(seconds: float) -> None:
    """After `seconds`: SIGKILL every server group this run started and exit 124 (the soft deadline's unwind
    did not finish)."""

    def fire() -> None:
        time.sleep(seconds)
        print('{"measure": "error", "error": "watchdog: the run did not end; servers killed"}', flush=True)
        for pid in _server_children().values():
            _kill_group(pid)
        os._exit(124)

    threading.Thread(target=fire, daemon=True, name="bench-watchdog").start()


def _metric(base: str, name: str) -> float | None:
    import httpx

    try:
        text = httpx.get(f"{base}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    found = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.M)
    return float(found[1]) if found else None


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


_T0 = time.monotonic()


def _call(label: str, source: Any, batch: Any) -> list[Any]:
    """`source.infer(batch)` with a progress line on stderr (seconds since start, the call's seconds), so a
    stalled or slow call shows where it is."""
    print(f"[bench_fleet +{time.monotonic() - _T0:.1f} s] {label}: {len(batch.infer_requests)} rows ...",
          file=sys.stderr, flush=True)  # fmt: skip
    started = time.monotonic()
    results = source.infer(batch)
    seconds = time.monotonic() - started
    print(f"[bench_fleet +{time.monotonic() - _T0:.1f} s] {label}: done in {seconds:.2f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return results


def _row_tokens(results: list[Any]) -> list[list[int]]:
    return [list(r.choices[0].token_ids) for r in results]


def measure_identity(emit: Any, one: Any, fleet: Any, batch: Any, healths: list[dict[str, Any]]) -> int:
    """1 of the module docstring; returns the longest prompt's token count."""
    from shared_schemas.chunking import plan_chunks

    alone = _call("identity, 1 server", one, batch)
    again = _row_tokens(_call("identity, 1 server again", one, batch))
    spread = _call(f"identity, {len(fleet.endpoints)} servers", fleet, batch)
    a, b = _row_tokens(alone), _row_tokens(spread)
    differ = sum(x != y for x, y in zip(a, b, strict=True))
    prompts_differ = sum(x.prompt_token_ids != y.prompt_token_ids for x, y in zip(alone, spread, strict=True))
    n = len(fleet.endpoints)
    emit({
        "measure": "fleet_identity", "servers": n, "rows": len(a),
        "identical": differ == 0 and len(a) == len(b),
        "rows_differing": differ, "one_server_repeat_identical": again == a,
        "prompt_ids_differing": prompts_differ, "distinct_rows": len(set(map(tuple, a))),
        "chunk_rows": [c.stop - c.start for c in plan_chunks(len(a), n) if not c.empty],
        "temperature": batch.request_config.temperature, "max_new_tokens": batch.request_config.max_tokens,
        "mean_new_tokens": round(sum(map(len, a)) / max(len(a), 1), 1),
        "prompt_tokens": len(alone[0].prompt_token_ids), "seeds_head": (batch.seeds or [])[:3],
        "weight_versions": sorted({r.weight_version for r in alone + spread}),
        "servers_model_and_version": sorted({(h["model"], h["weight_version"]) for h in healths}),
    })  # fmt: skip
    return max(len(r.prompt_token_ids) for r in alone)


def _best_call(source: Any, batch: Any, repeats: int) -> tuple[float, list[float], list[Any]]:
    _call(f"throughput warm-up, {len(source.endpoints)} server(s)", source, batch)
    times, best = [], (math.inf, [])
    for _ in range(repeats):
        started = time.perf_counter()
        results = _call(f"throughput, {len(source.endpoints)} server(s)", source, batch)
        seconds = time.perf_counter() - started
        times.append(seconds)
        if seconds < best[0]:
            best = (seconds, results)
    return best[0], times, best[1]


def measure_throughput(emit: Any, one: Any, fleet: Any, batch: Any, repeats: int, engine_batch: int) -> float:
    """2 of the module docstring; returns the N-server best seconds."""
    n = len(fleet.endpoints)
    rows = len(batch.infer_requests)
    t1, all1, r1 = _best_call(one, batch, repeats)
    tn, alln, rn = _best_call(fleet, batch, repeats)
    tokens1 = sum(map(len, _row_tokens(r1)))
    tokensn = sum(map(len, _row_tokens(rn)))
    per_row = {len(t) for t in _row_tokens(r1) + _row_tokens(rn)}
    rate1, raten = tokens1 / t1, tokensn / tn
    emit({
        "measure": "fleet_throughput", "servers": n, "rows": rows, "engine_batch": engine_batch,
        "decode_rounds_one_server": math.ceil(rows / engine_batch),
        "decode_rounds_per_server_fleet": math.ceil(math.ceil(rows / n) / engine_batch),
        "new_tokens_per_row": sorted(per_row), "tokens": tokens1,
        "seconds_1": round(t1, 3), f"seconds_{n}": round(tn, 3),
        "all_seconds_1": [round(t, 3) for t in all1], f"all_seconds_{n}": [round(t, 3) for t in alln],
        "tokens_per_s_1": round(rate1, 1), f"tokens_per_s_{n}": round(raten, 1),
        f"ratio_{n}_over_1": round(raten / rate1, 3), "bound": n, "target_for_3_servers": 2.6,
        "tokens_identical_1_vs_n": _row_tokens(r1) == _row_tokens(rn),
    })  # fmt: skip
    return tn


def measure_kill(
    emit: Any, rollout: Any, batch: Any, bases: list[str], pids: list[int], victim: int, expected_s: float
) -> None:
    """3 of the module docstring."""
    import httpx

    from learner.rollout.server_source import InferFailed, ServerRolloutSource

    url = bases[victim]
    timeout_s = rollout.read_timeout_s
    source = ServerRolloutSource.from_config(rollout)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-kill-call")

    def busy() -> bool:
        return (_metric(url, "rollmatch_infer_calls_in_flight") or 0) >= 1

    # Into its decode, long before the call ends; shorter on each try where the victim had already answered
    # when the kill was due (its chunk done, the others' not: uneven engines, e.g. CPU servers sharing cores).
    delay, attempts = min(0.1 * expected_s, 5.0), 0
    while attempts < 3:
        attempts += 1
        started = time.perf_counter()
        future = pool.submit(source.infer, batch)
        while time.perf_counter() - started < 60 and not future.done() and not busy():
            time.sleep(0.02)
        time.sleep(delay)
        if busy():
            break
        future.result(timeout=timeout_s + 30)  # every chunk answered: nothing tested yet
        delay /= 4
    else:
        why = "the victim had no call in flight when the kill was due: nothing killed"
        emit({"measure": "fleet_kill", "servers": len(bases), "victim_url": url, "attempts": attempts,
              "matches_policy": None, "error": why})  # fmt: skip
        source.close()
        pool.shutdown(wait=True)
        return
    killed_at = time.perf_counter()
    _kill_group(pids[victim])
    record: dict[str, Any] = {
        "measure": "fleet_kill", "servers": len(bases), "victim": victim, "victim_url": url,
        "attempts": attempts, "killed_after_s": round(killed_at - started, 3),
        "expected_call_s": round(expected_s, 2), "infer_timeout_s": timeout_s,
        "policy": "stop: InferFailed naming the dead server (docs/RUNBOOK.md; ServerRolloutSource retries)",
    }  # fmt: skip
    hung = False
    try:
        future.result(timeout=timeout_s + 30)
        record.update(raised=False, error=None)
    except FutureTimeout:
        hung = True
        record.update(raised=False, error=f"no answer within {timeout_s + 30:.0f} s")
    except Exception as exc:  # what the learner's step would see
        text = str(exc)
        others = [b for k, b in enumerate(bases) if k != victim and b in text]
        record.update(
            raised=True, error_type=type(exc).__name__, error=text[:800],
            error_url=getattr(exc, "url", None), names_dead_server=url in text, names_other_servers=others,
        )  # fmt: skip
    seconds = time.perf_counter() - killed_at
    record.update(
        seconds_kill_to_error=round(seconds, 3),
        seconds_call_to_error=round(seconds + killed_at - started, 3),
        hung=hung, within_timeout=seconds < timeout_s,
    )  # fmt: skip
    record["survivors_ok"] = [
        httpx.get(f"{b}/health", timeout=5).json().get("status") == "ok"
        for k, b in enumerate(bases)
        if k != victim
    ]
    record["matches_policy"] = bool(
        record["raised"] and record.get("error_type") == InferFailed.__name__
        and record.get("names_dead_server") and not record.get("names_other_servers")
        and record["within_timeout"]
    )  # fmt: skip
    emit(record)
    if not hung:  # a hung call's thread would block these; the servers' stop ends it instead
        source.close()
        pool.shutdown(wait=True)


def _run_config(args: Any, model_dir: Path, data: Path, bases: list[str], rows: int, tokens: int) -> Any:
    """The image demo's run config, pointed at this model, data and servers (trainer's sampling knobs)."""
    from learner.config import load_run_config

    return load_run_config(
        DEMO_CONFIG,
        {
            "output_dir": str(data.parent / "run"),
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "data": {"train": [str(data / "train.jsonl")], "eval": []},
            "rollout": {
                "servers": [{"base_url": b} for b in bases],
                "timeout_s": args.infer_timeout_s,
                "infer_timeout_s": args.infer_timeout_s,
                "sync": {"mode": "full", "transport": "http"},
                "decoding": {"temperature": 1.0, "max_new_tokens": tokens},
            },
            "training": {"eval_strategy": "no", "per_device_train_batch_size": rows,
                         "gradient_accumulation_steps": 1, "seed": 0},
            "stage2": {"sft_warmup_steps": 0},
        },
    )  # fmt: skip


def step_batch(cfg: Any, model_dir: Path, rows: int, global_step: int) -> Any:
    """The trainer's one rollout call of step `global_step` over the first `rows` demo records."""
    from transformers import AutoTokenizer

    from learner.trainers.build import load_samples, sample_context
    from learner.trainers.planner import StepPlanner

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = load_samples(cfg.data.train, cfg)[:rows]
    ctx = sample_context(cfg, tokenizer)
    planner = StepPlanner.from_config(cfg, None, ctx, batch_size=rows)  # type: ignore[arg-type]  # the caller sends
    return planner.step_batch([samples], global_step)


def fleet(args: Any, tmp: Path, emit: Any) -> None:
    """Model, data, servers, then the three measures."""
    import httpx
    import torch
    from _sync_gpu import _free, server_config
    from _vlm import vlm_model_dir
    from launcher_utils import running

    from learner.config import ServerEntry
    from learner.demo_data.images import write_image_dataset
    from learner.rollout.server_source import ServerRolloutSource
    from rollout_server.config import load_server_config

    cpu, n = args.cpu_check, args.servers
    started = time.perf_counter()
    model_dir = vlm_model_dir(args.model == "tiny-vlm", args.model_root / "model", "cpu" if cpu else "cuda:0")
    _free()
    emit({"measure": "model", "dir": str(model_dir), "seconds": round(time.perf_counter() - started, 1)})
    configs, bases, logs, cmds = [], [], [], []
    for k, gpu in enumerate(args.gpus):
        config, base, _ = server_config(model_dir, tmp, f"fleet-{k}", "auto")
        cmd = [sys.executable, "-m", "rollout_server", "--config", str(config), "--log-level", "WARNING"]
        cmds.append(cmd if cpu else ["env", f"CUDA_VISIBLE_DEVICES={gpu}", *cmd])
        configs.append(config)
        bases.append(base)
        logs.append(tmp / f"fleet-{k}.log")
    server_cfg = load_server_config(configs[0])
    engine_batch = server_cfg.hf.batch_size
    rows = n * engine_batch
    write_image_dataset(tmp / "data", rows, 0, seed=0)
    cfg = _run_config(args, model_dir, tmp / "data", bases, rows, args.identity_tokens)
    identity_batch = step_batch(cfg, model_dir, rows, global_step=1)
    tput_batch = identity_batch.model_copy(
        update={"request_config": identity_batch.request_config.model_copy(
            update={"max_tokens": args.tokens, "ignore_eos": True})}
    )  # fmt: skip

    def rollout_for(urls: list[str]) -> Any:
        return cfg.rollout.model_copy(update={"servers": [ServerEntry(base_url=u) for u in urls]})

    try:
        with ExitStack() as stack:
            started = time.perf_counter()
            contexts = [
                running(cmd, f"{base}/health", log, deadline_s=args.start_timeout_s)
                for cmd, base, log in zip(cmds, bases, logs, strict=True)
            ]
            with ThreadPoolExecutor(max_workers=n) as pool:  # load the servers side by side
                starts = list(pool.map(stack.enter_context, contexts))
            children = _server_children()
            pids = [children[str(c)] for c in configs]
            emit({"measure": "servers_start", "servers": n, "server_gpus": None if cpu else args.gpus,
                  "seconds": round(time.perf_counter() - started, 1), "each_s": [round(s, 1) for s in starts],
                  "engine_batch": engine_batch, "rows": rows})  # fmt: skip
            one = stack.enter_context(ServerRolloutSource.from_config(rollout_for(bases[:1])))
            many = stack.enter_context(ServerRolloutSource.from_config(rollout_for(bases)))
            healths = [httpx.get(f"{b}/health", timeout=10).json() for b in bases]
            prompt_len = measure_identity(emit, one, many, identity_batch, healths)
            t_fleet = measure_throughput(emit, one, many, tput_batch, args.repeats, engine_batch)
            if n > 1:  # longer rows (up to 3x, as max_model_len allows): the kill lands well inside the call
                longer = max(args.tokens, min(3 * args.tokens, server_cfg.vllm.max_model_len - prompt_len))
                kill_batch = tput_batch.model_copy(
                    update={
                        "request_config": tput_batch.request_config.model_copy(update={"max_tokens": longer})
                    }
                )
                expected_s = t_fleet * longer / args.tokens
                measure_kill(emit, rollout_for(bases), kill_batch, bases, pids, args.kill_server, expected_s)
    except BaseException as exc:
        emit({"measure": "error", "error": f"{type(exc).__name__}: {exc}"[:2000],
              "server_log_tails": {str(k): _tail(log) for k, log in enumerate(logs)}})  # fmt: skip
        raise
    finally:
        if args.server_log_dir:
            for log in logs:
                if log.exists():
                    shutil.copy(log, Path(args.server_log_dir) / log.name)
        if not cpu:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=3, help="N: servers of the fleet (>= 1)")
    parser.add_argument(
        "--server-gpus", default=None, help="the servers' CUDA_VISIBLE_DEVICES, default 1,..,N"
    )
    parser.add_argument("--cpu-check", action="store_true", help="servers on this host's CPU (tiny model)")
    parser.add_argument("--model", choices=("tiny-vlm", "vlm-2b"), default=None,
                        help="default tiny-vlm with --cpu-check, else vlm-2b")  # fmt: skip
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument(
        "--tokens", type=int, default=None, help="new tokens per row (throughput); 128, CPU 8"
    )
    parser.add_argument(
        "--identity-tokens", type=int, default=None, help="new tokens cap of the identity call"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls after the warm-up; 3, CPU 2")
    parser.add_argument("--kill-server", type=int, default=None, help="index of the server killed (N // 2)")
    parser.add_argument("--infer-timeout-s", type=float, default=120.0, help="rollout.infer_timeout_s")
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="each server's start-up limit")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="the whole run's limit")
    parser.add_argument("--server-log-dir", default=None, help="copy each server's log here")
    args = parser.parse_args(argv)
    cpu = args.cpu_check
    args.model = args.model or ("tiny-vlm" if cpu else "vlm-2b")
    args.tokens = args.tokens or (8 if cpu else 128)
    args.identity_tokens = args.identity_tokens or (8 if cpu else 64)
    args.repeats = args.repeats or (2 if cpu else 3)
    n = args.servers
    if n < 1:
        parser.error("--servers must be >= 1")
    args.kill_server = n // 2 if args.kill_server is None else args.kill_server
    if not 0 <= args.kill_server < n:
        parser.error(f"--kill-server {args.kill_server} is not a server index of 0..{n - 1}")
    args.gpus = (
        [g.strip() for g in args.server_gpus.split(",")]
        if args.server_gpus
        else [str(k) for k in range(1, n + 1)]
    )
    if len(args.gpus) != n:
        parser.error(f"--server-gpus lists {len(args.gpus)} GPUs for --servers {n}")

    import torch
    from _sync_gpu import Emitter

    common: dict[str, Any] = {"bench": "bench_fleet", "cpu_check": cpu, "model": args.model}
    if not cpu:
        count = torch.cuda.device_count()
        if count < 1 or max(int(g) for g in args.gpus) >= count:
            parser.error(f"the learner takes GPU 0 and the servers GPUs {args.gpus}: {count} GPUs visible")
        common["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
    emit = Emitter(Path(args.out) if args.out else None, common)
    emit({"measure": "host", "servers": n, "torch": torch.__version__, "tokens": args.tokens,
          "identity_tokens": args.identity_tokens, "repeats": args.repeats})  # fmt: skip

    def deadline(*_: Any) -> None:  # the servers go first: a start-up wait or a call on them ends at once
        for pid in _server_children().values():
            _kill_group(pid)
        raise BenchDeadline(f"--deadline-s {args.deadline_s:.0f} s ran out; servers killed")

    signal.signal(signal.SIGALRM, deadline)
    signal.alarm(max(1, int(args.deadline_s)))
    _watchdog(args.deadline_s + 60)  # if even the unwind after the deadline hangs
    shm = os.path.isdir("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-", dir="/dev/shm" if shm else None))
    # The vlm-2b checkpoint (~4.3 GB) goes to tmpfs only where it has room for it and the servers' page cache.
    roomy = shm and shutil.disk_usage("/dev/shm").free > 16e9
    (REPO / ".cache").mkdir(exist_ok=True)
    args.model_root = tmp if roomy else Path(tempfile.mkdtemp(prefix="bench-fleet-", dir=REPO / ".cache"))
    try:
        fleet(args, tmp, emit)
    except Exception:
        traceback.print_exc()  # the error line names it only once the servers were started
        return 1
    finally:
        signal.alarm(0)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(args.model_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
