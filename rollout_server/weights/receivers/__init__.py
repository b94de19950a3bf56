"""The server side of the weight-sync transports (`rollout.sync.transport`), mirroring the learner's
`learner.weights.transports`: one receiver per transport name behind one interface of five verbs
(`base.Receiver`: begin, receive, prepare, commit, abort), registered in `RECEIVERS`: `http` (`http`), `shm`
(`shm`), both staging bucket files (`files`, in the server's `file_store`), and `gloo` / `nccl`
(`gloo_nccl`). `Receivers` holds one of each for a server's `weights.staging.SyncStaging`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from rollout_server.weights.receivers.base import (
    RECEIVERS,
    Receiver,
    ReceiverOptions,
    StagedSync,
    StagingAccess,
    Transfer,
    register,
)
from rollout_server.weights.receivers.file_store import STAGED_DIR_PREFIX, StagedFiles
from rollout_server.weights.receivers.files import FileReceiver
from rollout_server.weights.receivers.gloo_nccl import CollectiveReceiver, GlooReceiver, NcclReceiver
from rollout_server.weights.receivers.http import HttpReceiver
from rollout_server.weights.receivers.shm import ShmReceiver
from shared_schemas.sync import SyncBeginRequest

__all__ = [
    "RECEIVERS",
    "STAGED_DIR_PREFIX",
    "CollectiveReceiver",
    "FileReceiver",
    "GlooReceiver",
    "HttpReceiver",
    "NcclReceiver",
    "Receiver",
    "ReceiverOptions",
    "Receivers",
    "ShmReceiver",
    "StagedSync",
    "StagingAccess",
    "Transfer",
    "register",
]


class Receivers:
    """One receiver per transport name, sharing the server's staged bucket files.

    Args:
        shm_dir: `server.shm_dir`; None disables the `shm` route.
        collective_staging: `server.sync_staging`.
    """

    def __init__(
        self, shm_dir: Path | None, collective_staging: Literal["auto", "device", "host"] = "auto"
    ) -> None:
        self.files = StagedFiles(shm_dir)
        options = ReceiverOptions(self.files, collective_staging)
        self._by_name = {name: cls(options) for name, cls in RECEIVERS.items()}

    def __getitem__(self, name: str) -> Receiver:
        return self._by_name[name]

    def for_begin(self, request: SyncBeginRequest) -> Receiver:
        """The receiver that stages `request`'s sync: its collective group's, else the bucket files' (each
        bucket then comes as an HTTP body or as an shm file into the one sync)."""
        return self[request.collective.backend if request.collective is not None else HttpReceiver.name]

    def close(self) -> None:
        """Drops every staging file left (server shutdown)."""
        self.files.close()
