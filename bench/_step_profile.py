"""What `bench_packing.py --gpu --vlm` measures beside tokens/s: the varlen-vs-loop check of one packed step,
a torch.profiler breakdown of one packed step, the attention calls of one packed step replayed through each
varlen kernel, and the matmul ceiling of the card.

Every function takes ``step(batch)``: one learner step (``learner.stage2.step.micro_step_loss`` + backward,
attention set up as the trainer does) returning the loss tensor, so the numbers are those of the learner's own
path.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["attention_replay", "compare_varlen", "matmul_ceiling_tflops", "phase_split", "profile_step"]

Step = Callable[..., torch.Tensor]


def compare_varlen(model: torch.nn.Module, batch: Any, step: Step) -> dict[str, float]:
    """One packed row through the varlen kernel and through the per-segment loop: relative differences.

    Returns:
        ``loss_varlen``, ``loss_loop``, ``loss_rel_diff`` and ``grad_rel_diff``
        (‖g_varlen − g_loop‖ / ‖g_loop‖ over all parameter gradients, in float32).
    """
    out: dict[str, float] = {}
    grads = []
    for varlen in (True, False):
        model.zero_grad(set_to_none=True)
        loss = step(batch, varlen=varlen)
        out[f"loss_{'varlen' if varlen else 'loop'}"] = float(loss)
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    out["loss_rel_diff"] = abs(out["loss_varlen"] - out["loss_loop"]) / max(abs(out["loss_loop"]), 1e-12)
    out["grad_rel_diff"] = float((grads[0] - grads[1]).norm() / grads[1].norm())
    return out


_FORWARD_PARTS = {
    "vision_tower": lambda n: n.endswith("visual"),
    "lm_attention": lambda n: ".language_model.layers." in f".{n}" and n.endswith("self_attn"),
    "lm_mlp": lambda n: ".language_model.layers." in f".{n}" and n.endswith("mlp"),
    "lm_norms": lambda n: ".language_model." in f".{n}" and n.endswith("layernorm"),
    "lm_head": lambda n: n == "lm_head",
}
"""Module-name tests of the forward parts whose GPU time the profile reports (Qwen3-VL naming)."""

_KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "matmul", "xmma", "cublas")),
    ("norm/softmax/reduce", ("norm", "softmax", "reduce", "cross_entropy", "logsumexp")),
    ("elementwise/copy", ("elementwise", "vectorized", "copy", "cat", "index", "fill", "unrolled")),
)


_SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaMemcpyAsync",
    }
)
"""Ops whose count says how often the host may wait for the GPU (``.item()``, data-dependent shapes, copies
back): after each such wait the GPU idles until the host has launched the next kernels."""


def profile_step(step: Step, batch: Any, model: torch.nn.Module, out_path: str | None) -> dict[str, Any]:
    """torch.profiler of one packed step (after the caller's warm-up).

    Returns (all times in ms): ``wall_ms`` (host clock, synchronised), ``gpu_busy_ms`` (sum of kernel times),
    ``gpu_idle_ms`` (wall − busy: launch gaps and host-bound stretches), ``kernels`` (launches),
    ``forward_ms`` by part (GPU time of the kernels each part's forward launched; backward not split),
    ``forward_host_ms`` by part (host time inside each part's forward: Python, dispatch, launches),
    ``kernels_ms`` by kind (name patterns of `_KERNEL_KINDS`, forward + backward), ``host_ops_ms`` (CPU time
    inside aten ops, a lower bound on host time), ``host_syncs`` (counts of the `_SYNC_OPS`). The full op
    table goes to ``out_path``; with ``PROFILE_SYNC_STACKS=1`` also the Python stacks of one more step's
    synchronising calls (`_sync_stacks`); with ``PROFILE_GAPS=1`` the GPU's idle time by host place
    (`_idle_places`); with ``PROFILE_STEPS=n`` n back-to-back steps of ``batch`` profiled, figures per step.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    handles = []
    names = {}
    for name, module in model.named_modules():
        part = next((p for p, test in _FORWARD_PARTS.items() if test(name)), None)
        if part is None:
            continue
        names[module] = part

        def pre(mod, args, _part=part):  # noqa: ANN001, ANN202 - hook signature
            mod._rm_range = record_function(f"fwd::{_part}")
            mod._rm_range.__enter__()

        def post(mod, args, output):  # noqa: ANN001, ANN202 - hook signature
            mod._rm_range.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    stacks = bool(os.environ.get("PROFILE_SYNC_STACKS"))  # where the host waits: Python stacks of the syncs
    gaps = bool(os.environ.get("PROFILE_GAPS"))  # where the GPU idles: the host sync before each idle stretch
    repeats = int(os.environ.get("PROFILE_STEPS", "1"))  # back-to-back steps, figures per step
    cuda = next(model.parameters()).is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    try:
        with profile(activities=activities) as prof, _sync_markers(gaps and cuda) as places:
            start = time.perf_counter()
            for _ in range(repeats):
                step(batch)
            sync()
            wall = (time.perf_counter() - start) * 1e3 / repeats
    finally:
        for h in handles:
            h.remove()
    events = prof.key_averages()
    kernels = _kernels(prof)
    busy = sum(us for _, us in kernels) / 1e3 / repeats
    kinds: dict[str, float] = {}
    for name, us in kernels:
        low = name.lower()
        kind = next((k for k, pats in _KERNEL_KINDS if any(p in low for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / repeats
    forward: dict[str, float] = {}
    forward_host: dict[str, float] = {}
    for e in events:
        if e.key.startswith("fwd::"):
            part = e.key.removeprefix("fwd::")
            forward[part] = max(forward.get(part, 0.0), round(e.device_time_total / 1e3 / repeats, 2))
            forward_host[part] = max(forward_host.get(part, 0.0), round(e.cpu_time_total / 1e3 / repeats, 2))
    host = sum(e.self_cpu_time_total for e in events if not e.key.startswith(("fwd::", "cuda"))) / 1e3
    syncs = {e.key: e.count for e in events if e.key in _SYNC_OPS}
    if out_path:
        with open(out_path, "w") as fh:
            fh.write(events.table(sort_by="self_cuda_time_total", row_limit=60))
            if stacks and cuda:
                fh.write(
                    "\n\nPython stacks of the host syncs of one more step (count, innermost frame first):\n"
                )
                for stack, count in _sync_stacks(step, batch).most_common(40):
                    fh.write(f"{count:5d} {stack}\n")
            if gaps and cuda:
                fh.write("\n\nHost time by op (self CPU):\n")
                fh.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
                fh.write("\n\nGPU idle (ms, stretches) by the host sync before it (innermost frame first):\n")
                for place, (ms, count) in _idle_places(prof, places)[:40]:
                    fh.write(f"{ms:8.2f} {count:5d} {place}\n")
    return {
        "wall_ms": round(wall, 1),
        "gpu_busy_ms": round(busy, 1),
        "gpu_idle_ms": round(wall - busy, 1),
        "kernels": len(kernels) // repeats,
        "steps": repeats,
        "forward_ms": forward,
        "forward_host_ms": forward_host,
        "kernels_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "host_ops_ms": round(host, 1),
        "host_syncs": syncs,
    }


def _sync_stacks(step: Step, batch: Any) -> collections.Counter:
    """Counts of the Python places (8 innermost frames outside torch) at which one step makes the host wait
    for the GPU."""
    with _sync_markers(True, depth=8) as places:
        step(batch)
        torch.cuda.synchronize()
    return collections.Counter(places)


@contextlib.contextmanager
def _sync_markers(enabled: bool, depth: int = 4) -> Iterator[list[str]]:
    """While enabled, every synchronising CUDA call (CUDA's sync debug mode: a warning at each) leaves a
    profiler marker ``sync#i`` and its Python place (``depth`` innermost frames outside torch) at index ``i``
    of the yielded list."""
    import sys
    import warnings

    places: list[str] = []
    if not enabled:
        yield places
        return
    from torch.profiler import record_function

    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        frame, frames = sys._getframe(2), []
        while frame is not None and len(frames) < depth:
            name = frame.f_code.co_filename
            # site-packages/torch only: a venv may itself live under a folder named torch (/opt/torch/.venv)
            if "/site-packages/torch/" not in name and "/warnings" not in name:
                frames.append(f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        with record_function(f"sync#{len(places)}"):
            places.append(" <- ".join(frames))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield places
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


def _idle_places(
    prof: Any, places: list[str], min_gap_us: float = 5.0
) -> list[tuple[str, tuple[float, int]]]:
    """GPU idle time of one profiled step (gaps of ≥ ``min_gap_us`` between kernels and copies) summed by the
    host sync (`_sync_markers`) issued since the GPU last resumed: the GPU drained while the host waited
    there, then idled until the host launched again. Gaps with no sync before them are launch-bound."""
    import bisect

    events = prof.events()
    device = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(("fwd::", "sync#", "phase::"))
    )
    marks = sorted(
        (e.time_range.start, int(e.name.removeprefix("sync#")))
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("sync#")
    )
    times = [t for t, _ in marks]
    totals: dict[str, list[float]] = {}
    end = device[0][1] if device else 0.0
    resumed = device[0][0] if device else 0.0
    for start, stop in device[1:]:
        if start - end >= min_gap_us:
            i = bisect.bisect_right(times, start) - 1
            place = "(no sync since the GPU resumed: launch-bound)"
            if i >= 0 and times[i] >= resumed:
                k = marks[i][1]
                place = places[k] if k < len(places) else f"sync#{k}"
            total = totals.setdefault(place, [0.0, 0])
            total[0] += (start - end) / 1e3
            total[1] += 1
            resumed = start
        end = max(end, stop)
    return sorted(((k, (round(v[0], 2), int(v[1]))) for k, v in totals.items()), key=lambda kv: -kv[1][0])


_PHASE_HOOKS = (
    ("vision", "merge", lambda n: n.endswith("visual")),
    ("lm", "head", lambda n: n.endswith("language_model")),
)
"""(phase at a module's forward start, phase at its end, module-name test): where `phase_split` cuts the
forward (Qwen3-VL naming; a module that does not exist cuts nothing)."""


def phase_split(step: Step, rows: list[Any], model: torch.nn.Module) -> dict[str, Any]:
    """Where one packed step's GPU idle time sits: the step cut into phases (``embed`` from the forward's
    start to the vision tower, ``vision``, ``merge`` (the image features into the text embeddings), ``lm``,
    ``head``, ``loss`` (from the forward's return to ``backward()``), ``backward``), each phase's host span
    and GPU span (CUDA events at the cuts, nothing profiled) averaged over ``rows[1:]``, and each phase's
    kernel time from one profiled step of ``rows[0]`` (the backward's launches come from autograd's
    threads: its kernel time is the rest of the step's). ``idle_ms`` = GPU span − kernel time. Kernels count
    in the phase that LAUNCHED them: where the GPU lags the host, a forward phase's kernel time exceeds its
    span (negative idle) and the next phase's is short; the spans and the step's total idle are exact.

    ``step(batch, mark=...)`` must call ``mark("loss")`` after the forward and ``mark("backward")`` before
    ``backward()``. Times in ms."""
    from torch.profiler import ProfilerActivity, profile, record_function

    marks: list[tuple[str, float, Any]] = []
    ranges: list[Any] = []
    profiling = [False]

    cuda = next(model.parameters()).is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True) if cuda else _HostEvent()
        event.record()
        marks.append((name, time.perf_counter(), event))
        if profiling[0]:
            while ranges:
                ranges.pop().__exit__(None, None, None)
            if name != "end":
                ranges.append(record_function(f"phase::{name}"))
                ranges[-1].__enter__()

    handles = [model.register_forward_pre_hook(lambda m, a: mark("embed"))]
    for start, end, test in _PHASE_HOOKS:
        for name, module in model.named_modules():
            if name and test(name):
                handles += [module.register_forward_pre_hook(lambda m, a, s=start: mark(s)),
                            module.register_forward_hook(lambda m, a, o, e=end: mark(e))]  # fmt: skip
                break
    try:
        host: dict[str, list[float]] = collections.defaultdict(list)
        gpu: dict[str, list[float]] = collections.defaultdict(list)
        for batch in rows[1:]:
            marks.clear()
            sync()
            step(batch, mark=mark)
            mark("end")
            sync()
            for (name, t0, e0), (_, t1, e1) in itertools.pairwise(marks):
                host[name].append((t1 - t0) * 1e3)
                gpu[name].append(e0.elapsed_time(e1))
        marks.clear()
        profiling[0] = True
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            step(rows[0], mark=mark)
            mark("end")
            sync()
        profiling[0] = False
    finally:
        for h in handles:
            h.remove()
    kernel = {e.key.removeprefix("phase::"): e.device_time_total / 1e3 for e in prof.key_averages()
              if e.key.startswith("phase::")}  # fmt: skip
    total = sum(us for _, us in _kernels(prof)) / 1e3
    kernel["backward"] = total - sum(v for k, v in kernel.items() if k != "backward")
    out = {}
    for name in host:
        span = statistics.fmean(gpu[name])
        out[name] = {"host_ms": round(statistics.fmean(host[name]), 2), "gpu_span_ms": round(span, 2),
                     "kernel_ms": round(kernel.get(name, 0.0), 2),
                     "idle_ms": round(span - kernel.get(name, 0.0), 2)}  # fmt: skip
    return {"phases": out, "step_ms": round(sum(v["gpu_span_ms"] for v in out.values()), 1),
            "idle_ms": round(sum(v["idle_ms"] for v in out.values()), 1)}  # fmt: skip


class _HostEvent:
    """`torch.cuda.Event`'s timing interface on the host clock (a CPU run of `phase_split`)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _HostEvent) -> float:
        return (other.t - self.t) * 1e3


def _kernels(prof: Any) -> list[tuple[str, float]]:
    """`(name, µs)` of every GPU kernel of a profile: the device-side events where the profiler lists them,
    else the kernels attached to the host events (older layouts)."""
    # The device timeline also holds the `fwd::` ranges (GPU user annotations): not kernels.
    device = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("fwd::", "phase::"))
    ]
    if device:
        return [(e.name, float(e.time_range.elapsed_us())) for e in device]
    return [(k.name, float(k.duration)) for e in prof.events() for k in getattr(e, "kernels", [])]


def attention_replay(step: Step, batch: Any, reps: int = 5) -> dict[str, Any]:
    """The attention calls of one packed step of ``batch`` (every ``segment_sdpa`` call with segment bounds:
    the vision tower's and the language model's) replayed on random tensors of their shapes through each
    kernel that runs here: the varlen kernels of ``learner.kernels.VARLEN_KERNEL_NAMES`` (where
    ``varlen_kernel`` picks that kernel for the call's configuration) and the per-segment SDPA loop.
    Forward + backward of all calls of a tower, ``reps`` times after one untimed pass (a JIT kernel compiles
    there): the median and spread in ms, and the forward alone. Times are CUDA events on CUDA, the host
    clock elsewhere.

    Returns:
        ``{"calls": {tower: {count, tokens, heads, heads_kv, head_size, segments}}, tower: {kernel: {...}}}``
        with tower ``vision`` (non-causal calls) and ``language`` (causal ones).
    """
    from transformers import AttentionInterface

    from learner.kernels import VARLEN_KERNEL_NAMES
    from learner.kernels import attention as pa

    recorded: list[tuple] = []

    def record(original, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, **kw):  # fmt: skip
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if kw.get("cu_seq_lens_q") is not None:
            recorded.append((query.shape, key.shape, query.dtype, kw["cu_seq_lens_q"].detach().clone(),
                             causal, scaling))  # fmt: skip
        return original(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kw)

    originals = pa.attention_functions()
    pa.register_attention_functions()
    for name, original in originals.items():
        AttentionInterface.register(name, functools.partial(record, original))
    try:
        step(batch)
    finally:
        for name, original in originals.items():
            AttentionInterface.register(name, original)
    gen = torch.Generator(device=batch.input_ids.device).manual_seed(0)
    out: dict[str, Any] = {"calls": {}}
    for tower, causal in (("vision", False), ("language", True)):
        calls = [
            ([torch.randn(s, generator=gen, device=cu.device, dtype=dtype)
              for s in (q_shape, k_shape, k_shape)], cu, int((cu[1:] - cu[:-1]).max()), scaling)
            for q_shape, k_shape, dtype, cu, is_causal, scaling in recorded
            if is_causal == causal
        ]  # fmt: skip
        if not calls:
            continue
        (q0, k0, _), cu0, _, _ = calls[0]
        out["calls"][tower] = dict(count=len(calls), tokens=q0.shape[2], heads=q0.shape[1],
                                   heads_kv=k0.shape[1], head_size=q0.shape[3],
                                   segments=len(cu0) - 1)  # fmt: skip
        kernels = [k for k in VARLEN_KERNEL_NAMES if pa.varlen_kernel(q0, k0, causal=causal, choice=k) == k]
        out[tower] = {}
        for kernel in [*kernels, "loop"]:
            time_ms = functools.partial(_replay_ms, calls, kernel, causal)
            first = time_ms(True)
            both = sorted(time_ms(True) for _ in range(reps))
            forward = statistics.median(time_ms(False) for _ in range(reps))
            out[tower][kernel] = dict(fwd_bwd_ms=round(statistics.median(both), 2),
                                      fwd_bwd_ms_min=round(both[0], 2), fwd_bwd_ms_max=round(both[-1], 2),
                                      fwd_ms=round(forward, 2), first_ms=round(first, 1))  # fmt: skip
    return out


def _replay_ms(calls: list, kernel: str, causal: bool, backward: bool) -> float:
    """Milliseconds of `calls` (`attention_replay`'s) through `kernel` (a varlen kernel or ``loop``), with
    their backward or without; CUDA events on CUDA, the host clock elsewhere."""
    from learner.kernels import segment_loop, varlen_attention

    cuda = calls[0][1].is_cuda
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    start = time.perf_counter()
    with torch.enable_grad() if backward else torch.no_grad():
        for leaves, cu, max_len, scaling in calls:
            xs = [t.requires_grad_(backward) for t in leaves]
            if kernel == "loop":
                o = segment_loop(*xs, cu, causal=causal, scaling=scaling, dropout=0.0)
            else:
                o = varlen_attention(*xs, cu, max_len, causal=causal, scaling=scaling, kernel=kernel)
            if backward:
                torch.autograd.grad(o, xs, torch.ones_like(o))
    if cuda:
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)
    return (time.perf_counter() - start) * 1e3


def matmul_ceiling_tflops(n: int = 8192, reps: int = 10) -> float:
    """bf16 TFLOP/s of an n×n×n matrix product on random data (median of ``reps`` timed products after 3
    warm-ups), the practical ceiling that an MFU is judged against."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12
