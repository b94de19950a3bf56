"""The stages of `bench/bench_vllm_gpu.py`, one module each, over the run's context they share (`common`):
`probe`, `serving` (the `vllm` and `hf` stages), `vs_openai`, `adapter`, `colocate` and `grpo`. The command
line, and the order the stages run in, are `bench/bench_vllm_gpu.py`'s."""

__all__ = ["adapter", "colocate", "common", "grpo", "probe", "serving", "vs_openai"]
