"""vLLM weight-transfer engine of the collective transport (`gloo_nccl`): the
`vllm.distributed.weight_transfer` API of vLLM 0.26–0.32 (`compat`).

`CollectiveTransferEngine` is a `WeightTransferEngine` registered in `WeightTransferEngineFactory` under
`COLLECTIVE_BACKEND` (by `worker`, which vLLM imports in every worker before it builds the engine), switched
on through the engine's `weight_transfer_config`, and driven by `AsyncLLM.init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update` — the worker plumbing vLLM's own NCCL engine
uses. It differs from vLLM's NCCL engine in one way, on purpose: it does not load while receiving. The
received tensors are STAGED in the worker and loaded only at the sync's commit, through the same
`reload_weights` as every other transport (`worker.rollmatch_stage_received` + `rollmatch_commit_weights`), so
a learner that dies mid-broadcast leaves the served weights untouched; the cost is one model's worth of
staging memory per worker (GPU memory with `server.sync_staging: device`, pinned host memory with `host`),
which the file transports pay too. The receive itself is `weights.group_receive.receive_buckets`, the function
the HF engine uses: broadcasts land in device buffers, no host wait inside the loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from rollout_server.engines.vllm.compat import transfer_engine_base
from rollout_server.engines.vllm.worker import COLLECTIVE_BACKEND
from rollout_server.weights.group_receive import ReceivedTensors, open_receiver_group, receive_buckets
from shared_schemas.torch_common.process_group import retire_group

__all__ = ["COLLECTIVE_BACKEND", "CollectiveInitInfo", "CollectiveTransferEngine", "CollectiveUpdateInfo"]

logger = logging.getLogger(__name__)


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    """Rendezvous of one worker: the learner's store, the group token, this worker's rank."""

    backend: str
    master_address: str
    master_port: int
    group: str
    rank_offset: int
    """Rank of this engine's first worker; a worker joins as `rank_offset` + its tensor-parallel rank."""
    world_size: int
    timeout_s: float


@dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    """One sync's buckets: per bucket, `[name, safetensors dtype code, shape]` per tensor."""

    buckets: list[list[list[Any]]] = field(default_factory=list)
    timeout_s: float = 120.0
    staging: str = "auto"
    """`server.sync_staging`: `device`, `host` or `auto` (`weights.group_receive.resolve_staging`)."""


class CollectiveTransferEngine(transfer_engine_base()):  # type: ignore[misc]
    """vLLM weight-transfer engine that receives flattened buckets and STAGES them (loaded at commit)."""

    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.group_token: str | None = None
        self.received: ReceivedTensors = []

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Joins the learner's group (dropping any previous one)."""
        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = open_receiver_group(init_info, rank)
        self.group_token = init_info.group
        logger.info(
            "joined weight-sync group %s as rank %d of %d", init_info.group, rank, init_info.world_size
        )

    def start_weight_update(self) -> None:
        self.received = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receiving; the broadcast's wait() already did.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("no weight-sync group joined; the server joins one at the sync's begin")
        try:
            self.received = receive_buckets(
                self.group,
                [[(n, c, s) for n, c, s in bucket] for bucket in update_info.buckets],
                device=self.device,
                timeout_s=update_info.timeout_s,
                staging=update_info.staging,
            ).tensors
        except BaseException:
            self.received = []
            retire_group(self.group)  # a broadcast may still be pending in it: never torn down on this thread
            self.shutdown()  # the group is out of step with the learner: the next sync joins a new one
            raise

    def finish_weight_update(self) -> None:
        """Nothing to finish: the received tensors wait for the commit (`take_received`)."""

    def take_received(self) -> ReceivedTensors:
        """The staged tensors of the last update, handed over once."""
        received, self.received = self.received, []
        return received

    def shutdown(self) -> None:
        self.group = None
        self.group_token = None
        self.received = []
