"""`learner.kernels.patches._indexed_deepstack` against transformers' boolean-mask deepstack merge (Qwen3-VL):
the same values and the same gradients, for padded batches and a packed row, and the index found once per
mask."""

from __future__ import annotations

import pytest
import torch

from learner.kernels.patches import _indexed_deepstack


def _transformers_merge(hidden: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """`Qwen3VLTextModel._deepstack_process` of transformers 5.x."""
    hidden = hidden.clone()
    local = hidden[mask, :] + embeds
    hidden[mask, :] = local
    return hidden


@pytest.mark.parametrize("batch, length", [(1, 37), (3, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_merge_equals_the_mask_merge_in_values_and_gradients(batch, length, dtype) -> None:
    gen = torch.Generator().manual_seed(batch * 100 + length)
    mask = torch.rand(batch, length, generator=gen) < 0.4
    n = int(mask.sum())
    assert n > 0
    results = []
    for merge in (_transformers_merge, _indexed_deepstack):
        hidden = torch.randn(batch, length, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        embeds = torch.randn(n, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
        hidden.requires_grad_(True)
        embeds.requires_grad_(True)
        out = merge(hidden, mask.clone(), embeds)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        (out * weight).sum().backward()
        results.append((out.detach(), hidden.grad, embeds.grad))
    for reference, indexed in zip(*results, strict=True):
        torch.testing.assert_close(indexed, reference, rtol=0, atol=0)


def test_the_index_is_found_once_per_mask_and_reused_by_later_layers() -> None:
    mask = torch.tensor([[False, True, True, False, True]])
    hidden = torch.zeros(1, 5, 2)
    first = _indexed_deepstack(hidden, mask, torch.ones(3, 2))
    assert mask._rm_flat_index.tolist() == [1, 2, 4]
    mask._rm_flat_index = torch.tensor([0, 1, 2])  # a later layer reads the cached index, not the mask
    second = _indexed_deepstack(hidden, mask, torch.ones(3, 2))
    assert first[0, :, 0].tolist() == [0, 1, 1, 0, 1]
    assert second[0, :, 0].tolist() == [1, 1, 1, 0, 0]
