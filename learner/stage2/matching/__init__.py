"""Matching of a rollout's valid objects to the ground truth: maskIoU of boxes and polygons (exact ring
areas) and the gated one-to-one assignment that yields TP, FP and FN (docs/ALGORITHM.md#matching)."""

__all__: list[str] = []
