"""`python -m rollout_server --config <yaml> [--port N] [--host H] [--gpus 0,1]`.

Reads only the `server:` section of the YAML (a whole run's file works), validates it (any problem → one
line on stderr, exit 2), exports the engine's environment, serves until SIGINT/SIGTERM, and exits 1 when
the engine fails to load. `--print-launch-env` prints the resolved launcher variables as shell-quoted
`KEY=VALUE` lines and exits (used by `scripts/start_rollout_server.sh`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence

from rollout_server.config import ConfigError, ServerConfig, load_server_config
from shared_schemas.checkpoints import is_vl_checkpoint
from shared_schemas.vlm_shim import ensure_vl_imports

logger = logging.getLogger("rollout_server")

EXIT_CONFIG = 2
EXIT_LOAD_FAILED = 1
EXIT_PORT_IN_USE = 100


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags; they override the YAML (hyperparameters stay in the YAML)."""
    parser = argparse.ArgumentParser(prog="python -m rollout_server", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML with a server: section (extends: allowed)")
    parser.add_argument("--port", type=int, default=None, help="override server.port")
    parser.add_argument("--host", default=None, help="override server.host")
    parser.add_argument("--gpus", default=None, help="override server.gpus, e.g. 0,1,2")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--print-launch-env", action="store_true", help="print KEY=VALUE lines for the launcher and exit"
    )
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> ServerConfig:
    """Loads and checks the config; the model directory must exist (never a hub name)."""
    overrides = {"port": args.port, "host": args.host, "gpus": args.gpus}
    cfg = load_server_config(args.config, overrides=overrides)
    if not cfg.model_path.is_dir():
        raise ConfigError(
            f"{args.config}: server.model: {cfg.model!r} resolves to {cfg.model_path}, which is not a local"
            " directory; build or download the model first (scripts/build_tiny_models.py for the tiny one)"
        )
    return cfg


def launch_env(cfg: ServerConfig) -> dict[str, str]:
    """The variables `start_rollout_server.sh` needs, resolved from the config."""
    return {
        "HOST": cfg.host,
        "PORT": str(cfg.port),
        "GPUS": ",".join(str(g) for g in cfg.gpus) if cfg.gpus is not None else "",
        "MODEL": str(cfg.model_path),
        "BACKEND": cfg.backend,
        "DP": str(cfg.vllm.data_parallel_size),
        "TP": str(cfg.vllm.tensor_parallel_size),
        "KV_CACHE_SPACE_GB": str(cfg.vllm.kv_cache_space_gb or ""),
        "AUTH": "1" if cfg.auth_token is not None else "0",
    }


def export_engine_env(cfg: ServerConfig) -> None:
    """Environment the engine reads at start (set here, never deep in libraries).

    A Qwen-VL checkpoint on a host without torchvision (this repository's CPU machines) gets the import shim
    of `shared_schemas/vlm_shim/` in this process and on `PYTHONPATH` for the engine's processes; hosts with
    torchvision never load it.
    """
    if is_vl_checkpoint(cfg.model_path):
        ensure_vl_imports()
    if cfg.gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpus)
    if cfg.vllm.kv_cache_space_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.kv_cache_space_gb)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_launch_env:
        for key, value in launch_env(cfg).items():
            print(f"{key}={shlex.quote(value)}")
        return 0
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    export_engine_env(cfg)

    import uvicorn

    from rollout_server.app import create_app

    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_failure(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    listener = None
    if cfg.health_port is not None:
        from rollout_server.health_listener import HealthListener

        try:
            listener = HealthListener(cfg.host, cfg.health_port, time.monotonic())
        except OSError as exc:
            print(
                f"server.health_port {cfg.health_port} on {cfg.host} cannot be bound ({exc});"
                " choose another port",
                file=sys.stderr,
            )
            return EXIT_PORT_IN_USE
        listener.start()  # liveness answers while the engine loads
        logger.info("probe listener on %s:%d (scheduling: %s)", cfg.host, listener.port, listener.scheduling)
    app = create_app(cfg, on_load_failure=on_load_failure, health_listener=listener)
    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish for drain_timeout_s, then
    # cancels them (a cancelled /infer/ aborts its engine requests); the lifespan closes the engine; exit 0.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=int(max(1, round(cfg.drain_timeout_s))),
        )
    )
    logger.info("rollout server on http://%s:%d (%s, %s)", cfg.host, cfg.port, cfg.backend, cfg.model_path)
    # uvicorn re-raises the captured signal after its graceful shutdown, into the handler that was installed
    # before it ran; a no-op handler there makes a drained shutdown exit 0 (what orchestrators expect).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        if listener is not None:
            listener.stop()
    return EXIT_LOAD_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
