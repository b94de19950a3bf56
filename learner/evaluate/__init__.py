"""Evaluating a detector as its users do: one command (`python -m learner.evaluate`), the field's metrics
(F1 at several maskIoU thresholds, COCO AP) and pictures of what it predicts, over the training loop's own
evaluation path."""

__all__: list[str] = []
