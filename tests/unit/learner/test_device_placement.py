"""`restrict_to_one_gpu`: a learner process without torchrun sees one GPU, so HF never picks DataParallel
(pure logic: the environment and the device count are arguments)."""

from __future__ import annotations

import logging

import pytest

from learner.device_placement import restrict_to_one_gpu


def test_no_torchrun_and_four_devices_keeps_the_first_and_says_so(caplog) -> None:
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger="learner.device_placement"):
        assert restrict_to_one_gpu(env, 4) == "0"
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("4 GPUs visible and no torchrun: training on cuda:0 only")
    assert "torchrun --nproc-per-node 4" in message
    assert "set CUDA_VISIBLE_DEVICES to choose the GPU" in message


@pytest.mark.parametrize(
    ("visible", "count", "kept"),
    [("2,3", 2, "2"), (" 5 , 1", 2, "5"), ("GPU-1f2e,GPU-9a8b", 2, "GPU-1f2e")],
    ids=["indices", "spaces", "uuids"],
)
def test_an_existing_list_keeps_its_first_entry(visible: str, count: int, kept: str) -> None:
    env = {"CUDA_VISIBLE_DEVICES": visible}
    assert restrict_to_one_gpu(env, count) == kept
    assert env["CUDA_VISIBLE_DEVICES"] == kept


@pytest.mark.parametrize(
    "env",
    [
        {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "4"},
        {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
    ],
    ids=["rank0", "rank3-with-list"],
)
def test_torchrun_ranks_are_untouched(env: dict[str, str], caplog) -> None:
    before = dict(env)
    with caplog.at_level(logging.INFO, logger="learner.device_placement"):
        assert restrict_to_one_gpu(env, 4) is None
    assert env == before
    assert not caplog.records


@pytest.mark.parametrize(
    ("env", "count"),
    [({}, 1), ({}, 0), ({"CUDA_VISIBLE_DEVICES": "3"}, 1), ({"CUDA_VISIBLE_DEVICES": ""}, 0)],
    ids=["one", "cpu", "one-listed", "none-listed"],
)
def test_one_device_or_none_is_untouched(env: dict[str, str], count: int, caplog) -> None:
    before = dict(env)
    with caplog.at_level(logging.INFO, logger="learner.device_placement"):
        assert restrict_to_one_gpu(env, count) is None
    assert env == before
    assert not caplog.records


def test_local_rank_minus_one_is_no_launcher() -> None:
    """accelerate reads `LOCAL_RANK` -1 as "not distributed", so DataParallel would follow: narrowed too."""
    env = {"LOCAL_RANK": "-1"}
    assert restrict_to_one_gpu(env, 2) == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
