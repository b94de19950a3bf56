"""The reference policy (learner/grpo/reference.py): the CPU thread budget of its forward, and a frozen copy
taken on the host following the batch to the GPU (the Trainer places the policy after the copy is taken)."""

from __future__ import annotations

import pytest
import torch

from learner.grpo.batch import CompletionRow, collate_rows, completion_logps
from learner.grpo.reference import build_reference, threads_beside_rollout_engine


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_cpu_leaves_one_core_to_the_engine_and_restores(two_threads) -> None:
    with threads_beside_rollout_engine(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), threads_beside_rollout_engine(torch.device("cpu")):
        raise RuntimeError("forward failed")
    assert torch.get_num_threads() == 2  # restored on errors too


def test_accelerators_and_single_threads_are_untouched(two_threads) -> None:
    with threads_beside_rollout_engine(torch.device("cuda", 0)):
        assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    with threads_beside_rollout_engine(torch.device("cpu")):
        assert torch.get_num_threads() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_frozen_copy_taken_on_the_host_follows_the_batch_to_the_gpu(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = build_reference(model, beta=0.04)  # before training: the model is still on the CPU
    assert reference is not None and reference.kind == "frozen_copy"
    model.to("cuda")  # what the Trainer does at train start
    rows = [
        CompletionRow([5, 6, 7, 8], [9, 10, 11], None, 0.0),
        CompletionRow([5, 6], [12, 13, 14, 15], None, 0.0),
    ]
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in collate_rows(rows, pad_id=0).items()}
    got = reference.logps(batch)
    assert got.device.type == "cuda"
    assert next(reference.module.parameters()).device.type == "cuda"
    with torch.no_grad():
        torch.testing.assert_close(got, completion_logps(model, batch))  # untrained: reference = policy
