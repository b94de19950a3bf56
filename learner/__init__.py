"""The learner process: rollout-matching SFT and GRPO of a VLM detector on HF `Trainer` (`python -m learner`),
with rollouts from rollout servers over HTTP or from an engine colocated in the learner."""

__all__: list[str] = []
