"""The rollout server's vLLM backend: `VllmEngine` (`engine.py`) over vLLM's `AsyncLLM`, with its prompt
inputs, sampling params, streamed completions, repeat guard, LoRA adapters, two-phase weight updates and
worker side.

Nothing is imported here: the HF backend uses `inputs` alone, and must not load vLLM through `engine` →
`worker`.
"""

__all__: list[str] = []
