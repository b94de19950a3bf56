"""The token-aligned strict parser of a rollout: detokenization, the streaming scan for objects, their
validation, and the token cut at the last valid object (docs/ALGORITHM.md#parsing)."""

__all__: list[str] = []
