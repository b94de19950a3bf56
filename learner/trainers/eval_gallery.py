"""The training loop's picture of its predictions: at every evaluation, the same held-out images drawn with
their ground truth and the model's predictions (`learner.predictions.gallery`) into
`output_dir/gallery/step_XXXX.png`, and logged to TensorBoard as the image `eval/gallery` when TensorBoard is
a report target, so a user watches the predictions improve.

The images are fixed for the run: `stage2.eval.gallery_images` held-out samples with images, evenly spaced
over the evaluated list (first and last included). Text-only records draw nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from learner.predictions.gallery import write_gallery
from learner.predictions.records import SamplePrediction, sample_prediction
from learner.stage2.pipeline import RolloutEval
from shared_schemas.infer import InferResult

__all__ = ["EvalGallery"]

logger = logging.getLogger(__name__)


def _spread(n: int, k: int) -> list[int]:
    """`k` indices evenly spaced over `range(n)`, first and last included, ascending and distinct."""
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


class EvalGallery:
    """Collects the fixed samples' predictions during an evaluation and draws them afterwards.

    Args:
        samples: the held-out sample dicts the trainer evaluates (indices refer to this list).
        out_dir: the run's `output_dir` (pictures go to `out_dir/gallery/`).
        k: images per gallery (`stage2.eval.gallery_images`).
        tensorboard_dir: the TensorBoard log dir when TensorBoard is a report target, else None.
    """

    def __init__(
        self, samples: list[dict[str, Any]], out_dir: str | Path, k: int, tensorboard_dir: str | None = None
    ) -> None:
        with_images = [i for i, s in enumerate(samples) if s.get("images")]
        self.indices = {with_images[j] for j in _spread(len(with_images), k)} if k > 0 else set()
        self.samples = samples
        self.out_dir = Path(out_dir) / "gallery"
        self.tensorboard_dir = tensorboard_dir
        self._writer: Any = None
        self._picked: list[SamplePrediction] = []

    @property
    def enabled(self) -> bool:
        """Whether there is anything to draw (some held-out sample has an image and k > 0)."""
        return bool(self.indices)

    def begin(self) -> None:
        """Starts an evaluation: forgets the previous one's predictions."""
        self._picked = []

    def on_sample(self, index: int, result: InferResult, evaluation: RolloutEval) -> None:
        """`StepPlanner.evaluate`'s per-sample hook: keeps the fixed samples' predictions."""
        if index in self.indices:
            self._picked.append(sample_prediction(index, self.samples[index], result, evaluation))

    def write(self, step: int, f1: float | None = None) -> Path | None:
        """Draws `gallery/step_XXXX.png` (and the TensorBoard image); returns its path, None if empty."""
        if not self._picked:
            return None
        picked = [("held-out", s) for s in sorted(self._picked, key=lambda s: s.index)]
        title = f"step {step}" + (f" · eval F1 {f1:.3f}" if f1 is not None else "")
        path = write_gallery(picked, self.out_dir / f"step_{step:04d}.png", title=title)
        if self.tensorboard_dir is not None:
            self._log_image(path, step)
        return path

    def _log_image(self, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is None:
            self._writer = SummaryWriter(log_dir=self.tensorboard_dir, filename_suffix=".gallery")
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self._writer.add_image("eval/gallery", pixels, step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        """Closes the TensorBoard writer, if one was opened."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
