"""Tokens of false-positive objects that the unlikelihood loss penalizes (docs/ALGORITHM.md#fp-unlikelihood,
§12.5).

A false positive (FP) is a valid prediction the matching left unmatched (``MatchResult.fp``). Matching is
one-to-one, so a second prediction of an object another prediction already matched is an FP too: duplicates
are exactly what the penalty is for. Not penalized:

- matched predictions whose §9 targets failed (``YTrain.excluded``): they do overlap a GT object, the failure
  is the target builder's, not a wrong detection;
- invalid objects (the parser dropped them: a wrong number of values, a truncated entry): there is no
  geometry to call wrong, and their tokens are a format slip that the appended tail already corrects;
- anything after the cut or re-encoded at the token seam (those tokens are not the model's emissions).

With ``fp_unlikelihood_objects: duplicates`` only the FPs that repeat an object another prediction matched
are penalized (the caller selects them). The penalized positions are the FP's coordinate tokens
(``coords``) or only its first one (``first_coord``, where the model commits to the object's place): a
coordinate token is never a CE target in the prefix, so no position gets both a likelihood and an
unlikelihood term.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from learner.stage2.matching.breakdown import duplicate_predictions

if TYPE_CHECKING:
    from learner.stage2.matching.maskiou import Geom
    from learner.stage2.matching.match import MatchResult
    from learner.stage2.parse.parser import ParseResult

__all__ = ["FpObjects", "FpTokens", "fp_penalized_positions", "penalized_predictions"]

FpTokens = Literal["coords", "first_coord"]
"""Which tokens of an FP object are penalized (``stage2.loss.fp_unlikelihood_tokens``)."""

FpObjects = Literal["all", "duplicates"]
"""Which FP objects are penalized (``stage2.loss.fp_unlikelihood_objects``): every one, or the duplicates
(`learner.stage2.matching.breakdown.duplicate_predictions`)."""


def fp_penalized_positions(
    parse: ParseResult, fp_preds: Sequence[int], tokens: FpTokens, kept_len: int
) -> list[int]:
    """Assistant-local indices (0 = first Y_train token) of the penalized tokens of the FP predictions.

    Args:
        parse: the sample's parse; ``coord_token_indices`` of its valid objects index the rollout, which is
            the prefix for every kept token.
        fp_preds: indices into ``parse.valid_objects`` of the unmatched predictions.
        tokens: ``coords`` (every coordinate token of each FP) or ``first_coord`` (its first one).
        kept_len: prefix tokens kept as generated (the token seam); later positions are not penalized.

    Returns:
        Ascending, distinct positions, each on a coordinate token the model emitted.
    """
    positions: list[int] = []
    objects = parse.valid_objects
    for i in fp_preds:
        slots = [int(p) for p in objects[i].coord_token_indices]
        positions.extend(p for p in (slots[:1] if tokens == "first_coord" else slots) if p < kept_len)
    return sorted(set(positions))


def penalized_predictions(
    objects: FpObjects, preds: Sequence[Geom], gts: Sequence[Geom], match: MatchResult, maskiou_gate: float
) -> tuple[int, ...]:
    """The FP predictions (indices into the valid predictions ``preds``, ascending) to penalize: every
    unmatched one (``all``: ``match.fp``) or the duplicates among them (``duplicates``: an unmatched
    prediction whose best-overlapping GT object, at maskIoU >= ``maskiou_gate``, another prediction matched;
    `learner.stage2.matching.breakdown.duplicate_predictions`, what the evaluator counts)."""
    if objects == "all":
        return tuple(match.fp)
    return duplicate_predictions(preds, gts, match, maskiou_gate)
