"""Post-rollout packing shared by the SFT and GRPO trainers: selecting samples into micro-batches through
the carry buffer, and the packed rows (one row of several samples) the model consumes."""

__all__: list[str] = []
