"""The learner's weight-sync transports behind one interface (`base.Transport`), registered by name:
`http`, `shm`, `gloo`, `nccl` (`rollout.sync.transport`)."""

from learner.weights.transports import gloo_nccl, http, shm  # noqa: F401  (registers the transports)
from learner.weights.transports.base import TRANSPORTS, Transport, TransportOptions, build_transport, register

__all__ = ["TRANSPORTS", "Transport", "TransportOptions", "build_transport", "register"]
