"""Toy tokenizer and the spec/STAGE2.md §21 worked example, for target / label tests.

Vocabulary: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>``, 3 ``"\\n"``, then the printable
ASCII characters, then the multi-character pieces of the §21 illustrative tokenization, then the 1000
single-id coordinate tokens. ``encode`` is greedy longest match (special and coord tokens first), which
reproduces the §21.4 tail tokenization exactly; ``token_bytes`` lets the streaming detokenizer use its
byte table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from learner.stage2.coords import CoordVocab
from learner.stage2.gt import extract_gt
from learner.stage2.labels import build_segment
from learner.stage2.match import MatchingConfig, gt_geoms, match, pred_geoms
from learner.stage2.parse import ParseResult, parse_rollout
from learner.stage2.segment import Segment
from learner.stage2.targets import TargetsConfig, YTrain, build_y_train

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MULTI = [
    '{"', "object", '":', ' {"', "desc", ' "', '",', "bbox", ' ["', '"]', "},", "}}", ' [["', '"],', '"]]',
    "person", "dog", "cat", "rug", "poly",
]  # fmt: skip


class ToyTokenizer:
    """Greedy longest-match tokenizer over a fixed vocabulary (no normalization, no special-token adds)."""

    def __init__(self, extra: Sequence[str] = ()) -> None:
        vocab = [*SPECIALS, "\n"] + [chr(c) for c in range(32, 127)] + MULTI + list(extra)
        self.coord_base = len(vocab)
        vocab += [f"<|coord_{k}|>" for k in range(1000)]
        self.vocab = vocab
        self.index = {s: i for i, s in enumerate(vocab)}
        self.eos_token_id = self.index["<|im_end|>"]
        self.unk_token_id = None
        self._max_len = max(len(s) for s in [*MULTI, *extra])
        self._special = re.compile(r"<\|(?:coord_\d{1,3}|im_end|im_start|endoftext)\|>")

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        del add_special_tokens
        out: list[int] = []
        i = 0
        while i < len(text):
            m = self._special.match(text, i)
            if m and m.group(0) in self.index:
                out.append(self.index[m.group(0)])
                i = m.end()
                continue
            for n in range(min(self._max_len, len(text) - i), 0, -1):
                t = self.index.get(text[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                raise ValueError(f"toy tokenizer cannot encode {text[i]!r}")
        return out

    def decode(self, ids: Sequence[int], **kwargs: object) -> str:
        del kwargs
        return "".join(self.vocab[int(t)] for t in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocab[int(token_id)].encode("utf-8")

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        if isinstance(tokens, str):
            return self.index.get(tokens)
        return [self.index.get(t) for t in tokens]

    def ids_of(self, pieces: Sequence[str]) -> list[int]:
        """Ids of explicit pieces (each must be one vocabulary entry)."""
        return [self.index[p] for p in pieces]


TOKENIZER = ToyTokenizer()
COORDS = CoordVocab.from_ids(range(TOKENIZER.coord_base, TOKENIZER.coord_base + 1000))
EOT = TOKENIZER.index["<|im_end|>"]
NEWLINE = TOKENIZER.index["\n"]


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
PROMPT_IDS = [TOKENIZER.index["a"]] * PROMPT_LEN

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
    match: object
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
) -> Pipeline:
    """Run parse, match, build_y_train and build_segment on the toy tokenizer with the 300-token prompt."""
    coords = CoordVocab.from_ids(range(tokenizer.coord_base, tokenizer.coord_base + 1000))
    pr = parse_rollout(rollout_ids, tokenizer, coords)
    gts = extract_gt(list(gt_raw), sample_id=0).objects
    m = match(
        pred_geoms(pr.valid_objects, pr.response_token_ids, coords),
        gt_geoms(gts),
        matching or MatchingConfig(fn_cost=2.0),
    )
    y = build_y_train(
        pr,
        gts,
        m,
        tokenizer,
        coords,
        targets or TargetsConfig(),
        fn_desc_ce=fn_desc_ce,
        prefix_structure_ce=prefix_structure_ce,
    )
    seg = build_segment(
        PROMPT_IDS, y, tokenizer.index["<|im_end|>"], tokenizer.index["\n"], coords,
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
