"""The `ipc` handoff's wire format across two processes on one CUDA GPU, without vLLM
(`shared_schemas.torch_common.cuda_ipc`, `learner.rollout.colocate.ipc.pack_full_update`): the learner packs
cast tensors into one buffer, the message crosses a msgpack round trip (as vLLM's RPC carries it: no pickle),
a second process opens it, checks every tensor and copies it into its own parameters, as the worker's commit
does. Skipped without CUDA.

    pytest -q -m gpu tests/integration/test_cuda_ipc_gpu.py
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU"),
]


def _worker(message: bytes, expected: dict[str, torch.Tensor], out: Any) -> None:
    import msgspec

    from shared_schemas.torch_common.cuda_ipc import import_buffer

    try:
        handoff = msgspec.msgpack.decode(message)
        views = import_buffer(handoff, torch.device("cuda", 0))
        params = {name: torch.zeros(t.shape, dtype=t.dtype, device="cuda") for name, t in expected.items()}
        for name, view in views:
            params[name].copy_(view)  # the in-place commit's copy
        torch.cuda.synchronize()
        bad = [n for n, t in expected.items() if not torch.equal(params[n].cpu(), t)]
        out.put(("ok", sorted(n for n, _ in views), bad))
    except Exception as exc:  # reported to the test, which fails with it
        out.put(("error", repr(exc), []))


def test_packed_update_opens_in_another_process_with_the_cast_values() -> None:
    import msgspec

    from learner.rollout.colocate.ipc import pack_full_update

    gen = torch.Generator().manual_seed(0)
    learner = {
        "a.weight": torch.randn(33, 17, generator=gen),  # odd sizes: slots are aligned, not packed tight
        "b.bias": torch.randn(5, generator=gen),
        "norm.scale": torch.tensor(1.5),
        "tied.weight": torch.randn(8, 4, generator=gen),
    }
    specs = {"a.weight": ("BF16", (33, 17)), "b.bias": ("F32", (5,)), "norm.scale": ("BF16", ()),
             "tied.weight": ("F16", (8, 4)), "unsent.weight": ("BF16", (3, 3))}  # fmt: skip
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    packed = pack_full_update(
        ((n, t.cuda()) for n, t in learner.items()), specs, torch.device("cuda", torch.cuda.current_device())
    )
    expected = {n: t.to(dtypes[specs[n][0]]) for n, t in learner.items()}
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in expected.values())
    message = msgspec.msgpack.encode(packed.handoff)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(message, expected, out))
    proc.start()
    status, names, bad = out.get(timeout=120)
    proc.join(timeout=60)
    assert status == "ok", names
    assert names == sorted(learner) and bad == []
    del packed  # the learner frees the buffer only after the worker is done
