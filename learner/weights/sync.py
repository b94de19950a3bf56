"""When and how the learner's weights reach the rollout engine (docs/ALGORITHM.md#sync-cadence,
docs/ARCHITECTURE.md#weight-sync).

`WeightSyncPolicy.maybe_sync` is called right before the first fresh rollout of an optimizer step (never
on M-steps, never on zero-request steps); it syncs iff `global_step != last_synced_step` (which starts at
−1, so step 0 syncs — mandatory when the engine starts with dummy weights). Every sync goes through the
rollout source's `types.SyncTarget` seam (every `RolloutSource` is one), so servers and the colocated engine
are handled alike.

Modes (`rollout.sync.mode`): `full` merges the adapters, exports base-model names and sends everything;
`adapter` sends the PEFT adapter only (requests must then name it: `request_adapter`); `auto` picks
adapter when the engine reports LoRA and the model is a PEFT model, else full. With `fallback_to_full`,
any adapter failure warns once and switches to full for the rest of the run, syncing full at once.

Multi-rank runs: only rank 0 sends (and resolves the mode, which a second `all_ok` round then hands to every
rank, so every rank's requests name the adapter in adapter mode); every rank meets in `all_ok`, a collective
that ANDs each rank's success flag (and so is also the barrier before the next rollout). A failed sync on
rank 0 therefore stops every rank with an error instead of leaving the others waiting forever in a barrier.
The policy never imports `torch.distributed`: the trainer injects `is_rank0` and `all_ok`
(`learner.trainers.build.all_ranks_ok`). Under ZeRO-3 the export gathers are collectives, so the other ranks
run (and discard) the same export, and enter it only after a first `all_ok` round in which rank 0 says it
got that far.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from learner.weights.export import (
    adapter_state,
    exported_state,
    full_state_items,
    full_state_specs,
    is_peft_model,
    is_zero3,
)
from learner.weights.types import SyncError, SyncReport, SyncTarget, WeightUpdate
from shared_schemas.config import ConfigSection
from shared_schemas.sync import TransportName

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_ADAPTER_NAME", "SyncConfig", "WeightSyncPolicy"]

DEFAULT_ADAPTER_NAME = "rollmatch"
"""Name the synced adapter is served under (requests reference it in `request_config.adapter`)."""


class SyncConfig(ConfigSection):
    """`rollout.sync:` — how weights reach the rollout engine."""

    mode: Literal["full", "adapter", "auto"] = "full"
    """`full`: merged base weights; `adapter`: the PEFT adapter only; `auto`: adapter when the engine has
    LoRA and the model is a PEFT model, else full."""
    fallback_to_full: bool = True
    """On any adapter-sync failure: warn once, sync full now and for the rest of the run."""
    transport: TransportName = "http"
    """Server mode: buckets as HTTP bodies; as files in the shared staging dir (same host only); or broadcast
    over ONE process group with every server, one broadcast per bucket (`gloo` on CPU hosts, packed on the
    host; `nccl` on GPUs, packed on the learner's GPU and never through host memory: HTTP then carries only
    the control; full syncs only, adapter syncs stay on HTTP). Implementations:
    `learner.weights.transports`."""
    bucket_mb: int = Field(default=512, ge=1)
    """Upper bound of one safetensors bucket, MiB."""
    shm_dir: str | None = None
    """`shm` transport: the servers' `server.shm_dir` (`/health` does not expose it)."""
    shm_share_parameters: bool = True
    """`shm` with a learner on CPU: after a committed sync, the parameters that were sent as they are (no
    dtype cast, no adapter merge, no ZeRO-3 gather) move into the bucket files, so later syncs write only
    the headers and each server's load reads the learner's memory directly (the learner's copy into the
    files, bytes / memcpy, is gone; the tmpfs is the one the files used anyway). A file is trained in only
    after every server's commit has loaded it and let it go; a failed sync first moves the parameters back
    into private memory. False: every sync copies every byte (`learner.weights.transports.shm.ShmStager`)."""
    collective_address: str | None = None
    """`gloo`/`nccl`: this host's address as the servers reach it (the group's rendezvous store listens
    there); None = `127.0.0.1`, allowed only when every server is on this host."""
    collective_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """`gloo`/`nccl`: limit of each group rendezvous, each bucket broadcast and each server's prepare wait,
    seconds (a server that dies mid-sync fails the sync within it)."""


class WeightSyncPolicy:
    """Once-per-step lazy weight sync with adapter → full fallback.

    Args:
        config: `rollout.sync`.
        is_rank0: whether this process sends (default: single process).
        all_ok: blocks until every rank arrives and returns whether every rank passed True (default: single
            process, returns its argument).
        dtype: cast floating-point weights of a full sync to the engine's dtype (the server rejects a
            dtype mismatch); None sends the training dtype.
        seed: `training.seed`, logged with each sync.
        adapter_name: name the adapter is served under in adapter mode.
        seed_plan: the trainer's per-request seed formula for a step, logged with each sync (stage 2:
            `learner.rollout.seeds.stage2_seed_plan(seed)`); None logs only `training.seed`, never another
            trainer's formula (GRPO seeds its requests per prompt, `learner.grpo.rollouts.prompt_seed`).
    """

    def __init__(
        self,
        config: SyncConfig,
        *,
        is_rank0: Callable[[], bool] = lambda: True,
        all_ok: Callable[[bool], bool] = lambda ok: ok,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        adapter_name: str = DEFAULT_ADAPTER_NAME,
        seed_plan: Callable[[int], str] | None = None,
    ) -> None:
        self.config = config
        self._seed_plan_of = seed_plan
        self._is_rank0 = is_rank0
        self._all_ok = all_ok
        self._dtype = dtype
        self._seed = seed
        self._adapter_name = adapter_name
        self.last_synced_step = -1
        """Optimizer step of the last sync (−1: never)."""
        self.version = 0
        """Last weight version this policy sent (versions only grow; the server requires it)."""
        self.mode: Literal["full", "adapter"] | None = None
        """Effective mode, resolved at the first sync (`auto`) and switched to full by a fallback."""
        self.last_report: SyncReport | None = None
        """Report of the last successful sync (rank 0 only)."""
        self.last_agree_s = 0.0
        """Seconds the last `maybe_sync` waited in its closing all-rank agreement (0.0 on one rank's
        no-op): the wait for the slowest rank, kept out of the sync's own seconds."""

    @property
    def request_adapter(self) -> str | None:
        """The adapter name generate requests must reference (adapter mode), else None."""
        return self._adapter_name if self.mode == "adapter" else None

    def maybe_sync(self, model: nn.Module, global_step: int, source: SyncTarget) -> float:
        """Syncs iff `global_step != last_synced_step`; call right before the step's first fresh rollout.

        Args:
            model: the policy being trained (PEFT or plain; unwrapped from DDP/DeepSpeed).
            global_step: the optimizer step about to roll out.
            source: where rollouts come from.

        Returns:
            Seconds this rank spent syncing (0.0 when nothing was synced), for `time/weight_sync_s`: on rank 0
            the export, transfer and commit; on the others their share of ZeRO-3 gathers. The closing
            all-rank agreement, which waits for the slowest rank to reach this step, is not in it: it is
            `last_agree_s` (`time/weight_sync_agree_s`).

        Raises:
            SyncError: the sync failed (and no fallback applied).
        """
        self.last_agree_s = 0.0
        if global_step == self.last_synced_step:
            return 0.0
        started = time.perf_counter()
        failure: Exception | None = None
        zero3 = is_zero3(model)
        if self._is_rank0():
            try:
                self._prepare(model, source)
            except Exception as exc:  # re-raised below, after the other ranks learnt of it
                failure = exc
            # Under ZeRO-3 the other ranks are about to enter the export's gathers: they go in only if rank 0
            # does too (a server that is down at this point would otherwise leave them in a gather forever).
            if zero3:
                self._agree(failure is None, failure, global_step)
            if failure is None:
                try:
                    self._sync(model, global_step, source)
                except Exception as exc:
                    failure = exc
        elif zero3:
            self._agree(True, None, global_step)
            _drain(self._full_items(model))  # take part in the ZeRO-3 gathers rank 0 runs
        synced = time.perf_counter()
        self._agree(failure is None, failure, global_step)
        self._share_mode()
        self.last_synced_step = global_step
        self.last_agree_s = time.perf_counter() - synced
        return synced - started

    def _share_mode(self) -> None:
        """Every rank takes rank 0's effective mode: their requests must name the adapter in adapter mode
        (`request_adapter`), and only rank 0 resolved it (`auto`, a fallback to full). One more `all_ok` round
        in which the other ranks pass True, so the AND is rank 0's flag."""
        adapter = self._all_ok(self.mode == "adapter" if self._is_rank0() else True)
        self.mode = "adapter" if adapter else "full"

    def _agree(self, ok: bool, failure: Exception | None, global_step: int) -> None:
        """Meets every rank in `all_ok`; raises this rank's failure, or a SyncError when another failed."""
        everyone_ok = self._all_ok(ok)
        if failure is not None:
            raise failure
        if not everyone_ok:
            raise SyncError(
                f"weight sync of step {global_step} failed on rank 0 (its log names the server and the"
                " cause); this rank stops with it"
            )

    def _prepare(self, model: nn.Module, source: SyncTarget) -> None:
        """Resolves the mode (first sync) and the starting version (first sync of a resumed run)."""
        if self.mode is None:
            self.mode = self._resolve_mode(model, source)
        if self.version == 0:
            # A resumed run meets servers that already serve a higher version.
            self.version = source.health().weight_version

    def _sync(self, model: nn.Module, global_step: int, source: SyncTarget) -> None:
        if self.mode == "adapter":
            try:
                self.last_report = self._send_adapter(model, source)
            except SyncError as exc:
                if not self.config.fallback_to_full:
                    raise
                logger.warning(
                    "adapter sync failed (%s); falling back to full weight syncs for the rest of the run", exc
                )
                self.mode = "full"
        if self.mode == "full":
            self.last_report = self._send_full(model, source)
        report = self.last_report
        assert report is not None
        logger.info(
            "weight sync step %d: %s v%d, %.1f MiB via %s to %s in %.2f s; %s",
            global_step,
            report.mode,
            report.version,
            report.bytes / 2**20,
            report.transport,
            ", ".join(source.endpoints),
            report.seconds,
            self._seed_plan(global_step),
        )

    def _resolve_mode(self, model: nn.Module, source: SyncTarget) -> Literal["full", "adapter"]:
        wanted = self.config.mode
        if wanted != "full" and is_zero3(model):
            # Every rank must run the same gathers; a mode decided by rank 0 alone cannot promise that.
            raise ValueError(
                f"rollout.sync.mode {wanted!r} is not supported with ZeRO-3 partitioned weights; use 'full'"
            )
        if wanted == "auto":
            mode: Literal["full", "adapter"] = (
                "adapter" if is_peft_model(model) and source.health().lora_enabled else "full"
            )
        else:
            mode = wanted
        if mode == "adapter" and not is_peft_model(model):
            raise ValueError(
                "rollout.sync.mode 'adapter' needs a PEFT model (model.adapter: lora or dora); use 'full' or "
                "'auto'"
            )
        logger.info("weight sync mode: %s (configured %s)", mode, wanted)
        return mode

    def _next_version(self) -> int:
        # Every attempt takes a new number, so a retry never collides with a partly applied attempt.
        self.version += 1
        return self.version

    def _send_adapter(self, model: nn.Module, source: SyncTarget) -> SyncReport:
        started = time.perf_counter()
        config, state = adapter_state(model)
        update = WeightUpdate(
            mode="adapter",
            version=self._next_version(),
            tensors=state,
            adapter_config=config,
            adapter_name=self._adapter_name,
        )
        report = source.sync_weights(update)
        return _with_seconds(report, started)

    def _send_full(self, model: nn.Module, source: SyncTarget) -> SyncReport:
        started = time.perf_counter()
        with exported_state(model, self._dtype, bucket_bytes=self.config.bucket_mb * 2**20) as items:
            try:
                update = WeightUpdate(
                    mode="full",
                    version=self._next_version(),
                    tensors=items,
                    specs=full_state_specs(model, self._dtype),
                    parameters=self._shareable(model),
                )
                report = source.sync_weights(update)
            finally:
                if is_zero3(model):
                    _drain(items)  # the other ranks wait in the remaining gathers
        return _with_seconds(report, started)

    def _shareable(self, model: nn.Module) -> tuple[torch.Tensor, ...]:
        """The parameters the transport may move into its files (`shm_share_parameters`), else none."""
        if self.config.transport != "shm" or not self.config.shm_share_parameters or is_zero3(model):
            return ()
        return tuple(model.parameters())

    def _full_items(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        return full_state_items(model, self._dtype, bucket_bytes=self.config.bucket_mb * 2**20)

    def _seed_plan(self, global_step: int) -> str:
        if self._seed_plan_of is not None:
            return self._seed_plan_of(global_step)
        if self._seed is None:
            return "seed plan: per-request seeds from the batch"
        return f"seed plan: training.seed {self._seed} (per-request seeds set by the trainer)"


def _drain(items: Iterator[object]) -> None:
    for _ in items:
        pass


def _with_seconds(report: SyncReport, started: float) -> SyncReport:
    """The source times the transfer; the policy's figure includes the export (merge, gather, cast)."""
    return replace(report, seconds=time.perf_counter() - started)
