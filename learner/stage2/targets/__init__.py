"""Teacher-forcing targets of one rollout: prefix coordinate targets (OT), `Y_train`, the CE-mask spans,
and the labelled segment that packing consumes (docs/ALGORITHM.md#prefix-targets to #labels)."""

__all__: list[str] = []
