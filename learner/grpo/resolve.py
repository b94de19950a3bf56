"""Config resolver for the GRPO launchers (docs/ALGORITHM.md#grpo-rules, §6).

``python -m learner.grpo.resolve --config X.yaml [--host H] [--port N] [--server-gpus 0,1]
[--train-gpus 6,7]`` loads the YAML (``extends`` chain), validates it with
:func:`learner.grpo.config.validate_grpo_run` and prints shell-quoted ``KEY=VALUE`` lines on stdout (exit 0),
or one ``config error: ...`` line on stderr (exit 2).

Launchers must read only lines matching ``^[A-Z][A-Z0-9_]*=`` (libraries may print other text): use
:func:`read_resolved` from Python or ``read_resolved`` from ``learner/grpo/read_resolved.sh`` in bash.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from learner.grpo.config import ResolvedGrpoRun, validate_grpo_run
from shared_schemas.config import REPO_ROOT, ConfigError, load_yaml_with_extends

KEY_VALUE_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")
EXIT_CONFIG_INVALID = 2


def _csv(gpus: Sequence[int] | None) -> str:
    return ",".join(str(gpu) for gpu in gpus or ())


def resolved_env(run: ResolvedGrpoRun, config_path: Path) -> dict[str, str]:
    """The variables the launchers read, as strings (booleans as ``true``/``false``)."""
    server = run.server
    return {
        "CONFIG": str(config_path),
        "SERVER_HOST": server.host,
        "SERVER_PORT": str(server.port),
        "SERVER_GPUS": _csv(server.gpus),
        "SERVER_TP": str(server.vllm.tensor_parallel_size),
        "SERVER_DP": str(server.vllm.data_parallel_size),
        "SERVER_ALLOW_NON_LOOPBACK": "true" if server.allow_non_loopback else "false",
        "SERVER_MODEL": str(server.model),
        "SERVER_BASE_URL": run.base_url,
        "TRAIN_GPUS": _csv(run.train_gpus),
        "NPROC": str(run.world_size),
        "MODEL_PATH": str(run.model_path),
        "ROLLOUT_TIMEOUT_S": f"{run.timeout_s:g}",
        "INFER_TIMEOUT_S": f"{run.infer_timeout_s:g}",
        "PER_DEVICE_BATCH_SIZE": str(run.per_device_batch_size),
        "GRADIENT_ACCUMULATION_STEPS": str(run.gradient_accumulation_steps),
        "EFFECTIVE_BATCH_SIZE": str(run.effective_batch_size),
        "NUM_GENERATIONS": str(run.grpo.num_generations),
        "OUTPUT_DIR": str(run.output_dir),
        "LOG_DIR": str(run.output_dir / "rollout_server"),
    }


def format_env(env: dict[str, str]) -> str:
    """``KEY=<shell-quoted value>`` lines, one per variable."""
    return "".join(f"{key}={shlex.quote(value)}\n" for key, value in env.items())


def read_resolved(text: str) -> dict[str, str]:
    """Reads the resolver's ``KEY=VALUE`` lines from ``text``, ignoring every other line.

    A line counts only if it matches ``^[A-Z][A-Z0-9_]*=`` and its value is exactly one shell word
    (``shlex.split``); anything else a library printed is skipped.
    """
    env: dict[str, str] = {}
    for line in text.splitlines():
        match = KEY_VALUE_LINE.match(line)
        if match is None:
            continue
        try:
            words = shlex.split(match.group(2))
        except ValueError:
            continue
        if len(words) == 1:
            env[match.group(1)] = words[0]
    return env


def flag_overrides(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    """Dotted-key overrides from the launcher flags; host/port flags also move ``rollout.servers``."""
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["server.host"] = args.host
    if args.port is not None:
        overrides["server.port"] = args.port
    if args.server_gpus is not None:
        overrides["server.gpus"] = args.server_gpus
    if args.train_gpus is not None:
        overrides["train_gpus"] = args.train_gpus
    servers = (raw.get("rollout") or {}).get("servers")
    if (args.host or args.port) and isinstance(servers, list) and len(servers) == 1:
        parts = urlsplit(str(servers[0].get("base_url", "")))
        host = parts.hostname or "127.0.0.1"
        if args.host is not None and args.host not in ("0.0.0.0", "::"):
            host = args.host
        port = args.port if args.port is not None else parts.port
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        overrides["rollout.servers"] = [{**servers[0], "base_url": urlunsplit(parts._replace(netloc=netloc))}]
    return overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m learner.grpo.resolve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True, type=Path, help="run YAML (extends chain allowed)")
    parser.add_argument("--base-dir", type=Path, default=REPO_ROOT, help="base of relative paths (repo root)")
    parser.add_argument("--host", help="overrides server.host")
    parser.add_argument("--port", type=int, help="overrides server.port (and the learner's base_url port)")
    parser.add_argument("--server-gpus", help="overrides server.gpus, e.g. 0,1,2,3,4,5")
    parser.add_argument("--train-gpus", help="overrides train_gpus, e.g. 6,7")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0, or 2 on an invalid configuration)."""
    args = _parser().parse_args(argv)
    try:
        raw = load_yaml_with_extends(args.config)
        run = validate_grpo_run(raw, args.base_dir, flag_overrides(args, raw))
    except ConfigError as exc:
        sys.stderr.write(f"config error: {args.config}: {exc}\n")
        return EXIT_CONFIG_INVALID
    sys.stdout.write(format_env(resolved_env(run, args.config.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
