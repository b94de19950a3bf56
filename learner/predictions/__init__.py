"""What a detector predicted, sample by sample, as users read it: each evaluated sample's scored objects
matched to its ground truth (`records`), and pictures of them (`gallery`). The evaluation command and the
training loop's gallery both build on it."""

__all__: list[str] = []
