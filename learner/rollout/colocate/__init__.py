"""The colocated rollout engines: `ColocateRolloutSource` (`source.py`) drives one backend inside the learner,
vLLM (`vllm.py`, tensor parallel: `tp.py`) or the training model itself (`hf.py`), in process."""

from learner.rollout.colocate.backend import ColocateBackend, EngineStartError, EngineStatus
from learner.rollout.colocate.source import ColocateRolloutSource

__all__ = ["ColocateBackend", "ColocateRolloutSource", "EngineStartError", "EngineStatus"]
