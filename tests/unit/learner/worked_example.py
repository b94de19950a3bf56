"""The docs/ALGORITHM.md#worked-example worked example on the toy tokenizer, for target / label tests.

The tokenizer is ``tests/unit/learner/toy_tokenizer.ToyTokenizer`` (explicit pieces, greedy longest match,
single-id coordinate tokens) with the multi-character pieces of the §21 illustrative tokenization; its greedy
encoding of the §21.4 tail reproduces the 70 tail tokens exactly. ``run_pipeline`` runs parse → match →
Y_train → segment with the 300-token prompt of §21.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from learner.stage2.coords import CoordVocab
from learner.stage2.gt import extract_gt
from learner.stage2.matching.match import MatchingConfig, MatchResult, gt_geoms, match, pred_geoms
from learner.stage2.parse.parser import ParseResult, parse_rollout
from learner.stage2.targets.false_positives import penalized_predictions
from learner.stage2.targets.labels import build_segment
from learner.stage2.targets.segment import Segment
from learner.stage2.targets.y_train import TargetsConfig, YTrain, build_y_train
from tests.unit.learner.toy_tokenizer import ToyTokenizer

MULTI = [
    '{"', "object", '":', ' {"', "desc", ' "', '",', "bbox", ' ["', '"]', "},", "}}", ' [["', '"],', '"]]',
    "person", "dog", "cat", "rug", "poly",
]  # fmt: skip


def make_tokenizer(extra: Sequence[str] = ()) -> ToyTokenizer:
    """Toy tokenizer with the §21 pieces (plus ``extra`` pieces)."""
    return ToyTokenizer([*MULTI, *extra])


@cache
def _coords(tokenizer: ToyTokenizer) -> CoordVocab:
    return CoordVocab.from_tokenizer(tokenizer)


def piece(tokenizer: ToyTokenizer, token_id: int) -> str:
    """Text of one token."""
    return tokenizer.decode([token_id])


TOKENIZER = make_tokenizer()
COORDS = _coords(TOKENIZER)
EOT = TOKENIZER.id_of("<|im_end|>")
NEWLINE = TOKENIZER.id_of("\n")


def c(k: int) -> str:
    return f"<|coord_{k}|>"


def _object_pieces(n: str, desc: str, bins: Sequence[int], close: str) -> list[str]:
    """Pieces of one rollout entry of §21.1 (starting with its key's opening quote token)."""
    out = ["object", "_", n, '":', ' {"', "desc", '":', ' "', desc, '",', ' "', "bbox", "_", "2", "d", '":']
    for j, k in enumerate(bins):
        out += [' ["' if j == 0 else ' "', c(k)] + (['",'] if j < len(bins) - 1 else [])
    return out + ['"]', close]


# §21.1: the 97-token rollout (stopped by max_new_tokens inside object_4's desc value).
ROLLOUT_PIECES: list[str] = (
    ['{"']
    + _object_pieces("1", "person", [104, 84, 296, 610], "},")
    + [' "']
    + _object_pieces("2", "dog", [880, 60, 990, 180], "},")
    + [' "']
    + _object_pieces("3", "cat", [20, 20, 60], "},")
    + [' "', "object", "_", "4", '":', ' {"', "desc", '":', ' "', "rug"]
)
ROLLOUT_IDS = TOKENIZER.ids_of(ROLLOUT_PIECES)
PROMPT_LEN = 300
PROMPT_IDS = [TOKENIZER.id_of("a")] * PROMPT_LEN

GT_RAW = [
    {"desc": "person", "bbox_2d": [100, 80, 300, 620]},
    {"desc": "dog", "bbox_2d": [520, 400, 760, 640]},
    {"desc": "rug", "poly": [400, 650, 900, 650, 900, 950, 400, 950]},
]

TAIL_TEXT = (
    ', "object_4": {"desc": "dog", "bbox_2d": ["<|coord_520|>", "<|coord_400|>", "<|coord_760|>", '
    '"<|coord_640|>"]}, "object_5": {"desc": "rug", "poly": [["<|coord_400|>", "<|coord_650|>"], '
    '["<|coord_900|>", "<|coord_650|>"], ["<|coord_900|>", "<|coord_950|>"], ["<|coord_400|>", '
    '"<|coord_950|>"]]}}'
)


@dataclass(frozen=True)
class Pipeline:
    """Every intermediate of one sample: parse → match → Y_train → segment."""

    parse: ParseResult
    gts: list
    match: MatchResult
    y_train: YTrain
    segment: Segment


def run_pipeline(
    rollout_ids: Sequence[int],
    gt_raw: Sequence[dict],
    *,
    tokenizer: ToyTokenizer = TOKENIZER,
    fn_desc_ce: bool = False,
    prefix_structure_ce: bool = False,
    matching: MatchingConfig | None = None,
    targets: TargetsConfig | None = None,
    fp_unlikelihood_tokens: str | None = None,
    fp_unlikelihood_objects: str = "all",
) -> Pipeline:
    """Run parse, match, build_y_train and build_segment on the toy tokenizer with the 300-token prompt."""
    coords = _coords(tokenizer)
    pr = parse_rollout(rollout_ids, tokenizer, coords)
    gts = extract_gt(list(gt_raw), sample_id=0).objects
    matching = matching or MatchingConfig(fn_cost=2.0)
    preds, gt_geometries = pred_geoms(pr.valid_objects, pr.response_token_ids, coords), gt_geoms(gts)
    m = match(preds, gt_geometries, matching)
    fp_preds = penalized_predictions(
        fp_unlikelihood_objects,  # type: ignore[arg-type]
        preds,
        gt_geometries,
        m,
        matching.maskiou_gate,
    )
    y = build_y_train(
        pr,
        gts,
        m,
        tokenizer,
        coords,
        targets or TargetsConfig(canonical_seam=False),  # the spec's §10 seam, as §21 works it out
        fn_desc_ce=fn_desc_ce,
        prefix_structure_ce=prefix_structure_ce,
        fp_unlikelihood_tokens=fp_unlikelihood_tokens,  # type: ignore[arg-type]
        fp_preds=fp_preds,
    )
    seg = build_segment(
        PROMPT_IDS, y, tokenizer.id_of("<|im_end|>"), tokenizer.id_of("\n"), coords,
        sample_id=7, base_idx=7, rollout_step=3,
    )  # fmt: skip
    return Pipeline(pr, gts, m, y, seg)


def rollout_of(objects: Sequence[tuple[str, str, Sequence[int]]], *, close_top: bool = True) -> list[int]:
    """Rollout ids in the §21.1 tokenization for bbox objects ``(n, desc, bins)``."""
    pieces = ['{"']
    for k, (n, desc, bins) in enumerate(objects):
        last = k == len(objects) - 1
        pieces += _object_pieces(n, desc, bins, "}}" if last and close_top else "},")
        if not last:
            pieces.append(' "')
    return TOKENIZER.ids_of(pieces) + ([EOT] if close_top else [])
