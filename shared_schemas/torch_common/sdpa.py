"""The SDPA kernels both processes allow on CUDA: every backend but cuDNN.

The cuDNN attention backend builds (and caches) one execution graph per input shape. A decode loop changes the
key length at every step, so each step of the first rollout at a new batch size paid a graph build (on an
H200 a 32-row, 128-token rollout of a 0.4B model took 6.9 s instead of 2.0 s, 16 ms per step); a packed row
calls attention once per segment, nearly every one a new length (on an H100 with a Qwen3-VL-2B-shaped model:
packed ÷ padded tokens/s 0.63× with cuDNN allowed, 1.34× without; bench/RESULTS.md). Used by the decode loop's
attention (`rollout_server.engines.decode_attention`) and the learner's packed attention
(`learner.kernels.attention`).
"""

from __future__ import annotations

from torch.nn.attention import SDPBackend

__all__ = ["NO_CUDNN_SDPA_BACKENDS"]

NO_CUDNN_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA kernels allowed on CUDA (`torch.nn.attention.sdpa_kernel`): every backend but cuDNN."""
