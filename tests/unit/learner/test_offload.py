"""Offload context (docs/ALGORITHM.md#offload, test of §20.11).

On this CPU-only machine the "training device" is the CPU itself, so the CPU smoke test records every
move through the module's ``_move`` seam and checks the bookkeeping (what moved where, and back to the
original device, also on exceptions). The same checks run against a real CUDA device when available.
"""

from __future__ import annotations

import pytest
import torch

from learner.rollout.colocate import offload
from learner.rollout.colocate.offload import offload_context


def _model_and_optimizer(device: str = "cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class _Recorder:
    """Stands in for ``_move``: records (original device, target device) and returns a fresh copy."""

    def __init__(self) -> None:
        self.moves: list[tuple[int, str]] = []

    def __call__(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.moves.append((tensor.numel(), str(device)))
        return tensor.to(device).clone()


@pytest.mark.parametrize("raise_inside", [False, True], ids=["clean-exit", "body-raises"])
def test_offload_moves_and_restores_cpu_smoke(monkeypatch: pytest.MonkeyPatch, raise_inside: bool) -> None:
    model, opt = _model_and_optimizer()
    recorder = _Recorder()
    monkeypatch.setattr(offload, "_move", recorder)
    before_params = [p.detach().clone() for p in model.parameters()]
    before_data = [p.data for p in model.parameters()]
    before_states = [t.clone() for t in _state_tensors(opt)]
    n_params, n_states = len(before_params), len(before_states)
    assert n_states > 0

    def body(report) -> None:
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert all(t.device.type == "cpu" for t in _state_tensors(opt))
        # every parameter's .data was replaced (moved), the Parameter objects are the same
        assert all(p.data is not d for p, d in zip(model.parameters(), before_data, strict=True))
        assert report.params_moved == n_params and report.optimizer_tensors_moved == n_states
        assert [d for _, d in recorder.moves] == ["cpu"] * (n_params + n_states)
        if raise_inside:
            raise RuntimeError("engine failed")

    if raise_inside:
        with pytest.raises(RuntimeError, match="engine failed"):
            with offload_context(model, opt, offload_model=True, offload_optimizer=True, enabled=True) as rep:
                body(rep)
    else:
        with offload_context(model, opt, offload_model=True, offload_optimizer=True, enabled=True) as rep:
            body(rep)
    # moved back: one more move per tensor, to the recorded original device, values intact
    assert len(recorder.moves) == 2 * (n_params + n_states)
    assert [d for _, d in recorder.moves[n_params + n_states :]] == ["cpu"] * (n_params + n_states)
    for p, want in zip(model.parameters(), before_params, strict=True):
        assert torch.equal(p.detach(), want)
    for t, want in zip(_state_tensors(opt), before_states, strict=True):
        assert torch.equal(t, want)
    assert rep.seconds >= 0.0 and rep.devices == {"cpu"}
    # the optimizer still steps on the same Parameter objects
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_restores_original_device_of_optimizer_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """``meta`` plays the accelerator: states must come back to ``meta``, not stay on the CPU.

    (Parameters cannot take this route: ``p.data = cpu_tensor`` is refused for a meta parameter.)
    """

    def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.is_meta:  # no data to copy: materialize zeros of the same shape
            return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
        return tensor.to(device)

    monkeypatch.setattr(offload, "_move", move)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        opt.state[p] = {"momentum_buffer": torch.empty(p.shape, device="meta")}
    with pytest.raises(KeyError):
        with offload_context(model, opt, offload_model=False, offload_optimizer=True, enabled=True) as rep:
            assert all(t.device.type == "cpu" for t in _state_tensors(opt))
            raise KeyError("body failed")
    assert all(t.is_meta for t in _state_tensors(opt)) and len(_state_tensors(opt)) == 2
    assert rep.devices == {"meta"} and rep.optimizer_tensors_moved == 2


def test_disabled_or_nothing_selected_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_optimizer()
    recorder = _Recorder()
    monkeypatch.setattr(offload, "_move", recorder)
    with offload_context(model, opt, offload_model=True, offload_optimizer=True, enabled=False) as rep:
        pass
    with offload_context(model, opt, offload_model=False, offload_optimizer=False, enabled=True):
        pass
    assert recorder.moves == [] and rep.params_moved == 0 and rep.seconds == 0.0


def test_model_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_optimizer()
    recorder = _Recorder()
    monkeypatch.setattr(offload, "_move", recorder)
    with offload_context(model, opt, offload_model=True, offload_optimizer=False, enabled=True) as rep:
        assert rep.optimizer_tensors_moved == 0
    assert len(recorder.moves) == 2 * len(list(model.parameters()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("raise_inside", [False, True])
def test_offload_real_cuda_device(raise_inside: bool) -> None:
    model, opt = _model_and_optimizer("cuda")
    try:
        with offload_context(model, opt, offload_model=True, offload_optimizer=True, enabled=True):
            assert all(p.device.type == "cpu" for p in model.parameters())
            assert all(t.device.type == "cpu" for t in _state_tensors(opt))
            if raise_inside:
                raise RuntimeError("boom")
    except RuntimeError:
        assert raise_inside
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(t.device.type == "cuda" for t in _state_tensors(opt) if t.dim() > 0)
