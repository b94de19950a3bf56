"""The batched Sinkhorn of ot.py is bit-identical to the §9 formula on the padded batch
(docs/ALGORITHM.md#prefix-targets).

``ot._sinkhorn`` drops the ``max(., 1e-300)`` of §9 (it never binds: kernel entries lie in [e^-50, 1], so the
scaled sums stay far above 1e-300) and gives padding kernel 1 instead of 0 (it only ever meets u = 0 or
v = 0). The reference below is the formula written out on the same padded batch, with kernel 0 on padding and
the max.
"""

from __future__ import annotations

import numpy as np
import pytest

from learner.stage2.targets.ot import barycentric_padded


def _reference_padded(preds, gts, cost: str, eps: float, iters: int):
    ns, ms = [len(p) for p in preds], [len(g) for g in gts]
    n_max, m_max = max(ns), max(ms)
    pp, gg = np.zeros((len(ns), n_max, 2)), np.zeros((len(ns), m_max, 2))
    for k, (p, g) in enumerate(zip(preds, gts, strict=True)):
        if len(p) and len(g):
            pp[k, : len(p)], gg[k, : len(g)] = np.asarray(p, float), np.asarray(g, float)
    n_arr, m_arr = np.array(ns), np.array(ms)
    live = (n_arr > 0) & (m_arr > 0)
    a = np.where(
        (np.arange(n_max) < n_arr[:, None]) & live[:, None], 1.0 / np.maximum(n_arr, 1)[:, None], 0.0
    )
    b = np.where(
        (np.arange(m_max) < m_arr[:, None]) & live[:, None], 1.0 / np.maximum(m_arr, 1)[:, None], 0.0
    )
    d = pp[:, :, None, :] - gg[:, None, :, :]
    c = np.sqrt((d * d).sum(-1)) if cost == "l2" else np.abs(d).sum(-1)
    kern = np.exp(np.clip(-c / eps, -50, 50)) * ((a > 0)[:, :, None] & (b > 0)[:, None, :])
    v = (b > 0).astype(float)
    with np.errstate(all="ignore"):
        for _ in range(iters):
            u = a / np.maximum(np.matmul(kern, v[:, :, None])[:, :, 0], 1e-300)
            v = b / np.maximum(np.matmul(kern.transpose(0, 2, 1), u[:, :, None])[:, :, 0], 1e-300)
        plan = u[:, :, None] * kern * v[:, None, :]
        mass = plan.sum(2)
        proj = np.matmul(plan, gg) / mass[:, :, None]
    row_real = (np.arange(n_max) < n_arr[:, None]) & live[:, None]
    ok = live & ((np.isfinite(proj).all(2) & (mass > 0)) | ~row_real).all(1)
    return proj, ok


@pytest.mark.parametrize("seed", range(40))
def test_padded_sinkhorn_is_bit_identical_to_the_formula(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bsz = int(rng.integers(1, 20))
    preds = [rng.integers(-50, 1050, (int(rng.integers(0, 10)), 2)).astype(float) for _ in range(bsz)]
    gts = [rng.integers(-50, 1050, (int(rng.integers(0, 10)), 2)).astype(float) for _ in range(bsz)]
    if seed % 4 == 1:
        preds = [p.tolist() for p in preds]  # nested lists, as targets.py passes them
    if seed % 7 == 3 and len(preds[0]):
        preds[0][0][0] = np.nan  # a NaN poisons its own pair only
    cost = "l1" if seed % 2 else "l2"
    eps = [1e-3, 0.5, 10.0, 1e3, 1e300][seed % 5]  # from "every kernel entry clipped" to "kernel == 1"
    iters = [1, 2, 30, 60][seed % 4]
    if max(len(p) for p in preds) == 0 or max(len(g) for g in gts) == 0:
        return
    proj, ok, ns = barycentric_padded(preds, gts, cost=cost, epsilon=eps, iters=iters)
    ref_proj, ref_ok = _reference_padded(preds, gts, cost, eps, iters)
    np.testing.assert_array_equal(proj, ref_proj)  # NaN == NaN here
    np.testing.assert_array_equal(ok, ref_ok)
    assert ns == [len(p) for p in preds]
