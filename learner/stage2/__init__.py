"""Rollout-matching SFT: a rollout is parsed (``parse/``), matched to the ground truth (``matching/``) and
turned into teacher-forcing targets (``targets/``); ``pipeline`` runs them per sample, ``losses`` scores."""

__all__: list[str] = []
