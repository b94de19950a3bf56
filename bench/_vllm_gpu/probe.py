"""Stage `probe`: the rollout server (vLLM backend) on the tiny Qwen2 is up within `--probe-timeout-s` and
answers one `/infer/`; else every process's stacks (`probe_stacks`) and a retry with
`VLLM_WORKER_MULTIPROC_METHOD=spawn`, kept for the later stages when it is the one that worked."""

from __future__ import annotations

from _vllm_gpu.common import REPO, Bench, Server, post_infer, token_count


def probe(bench: Bench) -> None:
    """The tiny Qwen2 on vLLM: up within the probe timeout, else stacks and a retry with spawn.

    Raises:
        RuntimeError: neither start method gave a healthy server.
    """
    model = REPO / "assets" / "tiny-qwen2-copy"
    for attempt, extra in enumerate(({}, {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})):
        bench.env.update(extra)
        server = Server(bench.server_section(model, "vllm"), bench.tmp, f"probe{attempt}", bench.env)
        try:
            seconds = server.start_healthy(bench.args.probe_timeout_s)
            if seconds is not None:
                result = post_infer(server.base, [{"prompt_token_ids": [1, 2, 3, 4]}], 8)
                bench.emit({"measure": "probe", "attempt": attempt, "started_s": round(seconds, 1),
                            "vllm_env": bench.vllm_env(), "tokens": token_count(result),
                            "log_tail": server.tail(1500)})  # fmt: skip
                return
            bench.emit({"measure": "probe_stacks", "attempt": attempt, "vllm_env": bench.vllm_env(),
                        "log": server.dump_stacks()})  # fmt: skip
        finally:
            server.stop()
    raise RuntimeError("the vLLM server did not start with either start method; see probe_stacks")
