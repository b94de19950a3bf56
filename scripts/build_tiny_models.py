"""Build the embedded tiny models offline: a Qwen2-architecture causal LM with a coord-token BPE tokenizer.

Nothing here touches the network. Everything is seeded and idempotent: a directory that already holds a build
with the same recipe (``build_info.json``) is left alone, so tests and the demo can call the builders freely.

The tokenizer is the same for every seed (it is trained once on a fixed corpus), so weights of the seed-0 and
seed-1 models are interchangeable parameter for parameter — that is what weight-sync tests rely on.

Tokenizer facts (what the learner and server rely on):
- byte-level BPE with Qwen2's pre-tokenizer regex, trained on the assistant JSON format, the default prompts
  and the demo vocabulary, so ``{"``, ``":``, `` {"``, ``",`` ... are single tokens as in
  docs/ALGORITHM.md#worked-example;
- Qwen chat special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and the Qwen-VL vision tokens;
- 1000 added coordinate tokens ``<|coord_0|>`` .. ``<|coord_999|>``, each ONE id, registered as non-special
  added tokens so that ``decode(..., skip_special_tokens=True)`` keeps them (engines return them in ``text``);
- a Qwen chat template: image parts render as ``<|vision_start|><|image_pad|><|vision_end|>``.

CLI: ``python scripts/build_tiny_models.py --out .cache/models`` writes ``tiny-qwen2`` (seed 0),
``tiny-qwen2-seed1`` (seed 1) and ``tiny-qwen2-copy`` (the model the demo trains, see below).

``tiny-qwen2-copy`` is ``tiny-qwen2`` after GENERIC copy pretraining (``scripts/copy_pretrain.py``: random
token sequences repeated with filler in between — no prompts, no JSON, nothing of the demo task). A random
2-layer model forms a copy ("induction") circuit only after a long plateau (≥ 25k samples, far beyond a
10-minute CPU demo); with it, rollout-matching SFT learns the demo in ~150–200 steps. The pretraining takes
~1 min on a GPU and ~10 min on 2 CPU cores, so its result is shipped in ``assets/tiny-qwen2-copy/`` (2 MB)
and only re-run when that folder is missing or its tokenizer no longer matches the builder's
(``--rebuild-copy`` forces it).
Shipped weights: ``python scripts/copy_pretrain.py --model-dir .cache/models/tiny-qwen2 --out DIR --seed 5
--device cuda`` (H200); its F1 is still 0 on the demo task until SFT.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository
from learner.demo_data.files import built_from, one_builder_at_a_time, recipe_key, staging_dir  # noqa: E402

logger = logging.getLogger(__name__)

RECIPE_VERSION = 5
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
COORD_TOKENS = [f"<|coord_{k}|>" for k in range(1000)]
# Qwen2's pre-tokenizer split pattern (tokenizer.json of the Qwen2 family).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Size presets. head_dim 64: vLLM's CPU attention rejects 16;
# hidden 128 keeps the test model ~0.5 MB of weights.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        initializer_range=0.1,
    ),
    "demo": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
}

DEMO_WORDS = [
    "person",
    "cat",
    "dog",
    "car",
    "tree",
    "rug",
    "sofa",
    "chair",
    "table",
    "lamp",
    "bird",
    "bike",
    "cup",
    "book",
    "plant",
    "unknown",
    "red",
    "green",
    "blue",
    "yellow",
    "small",
    "large",
    "scene",
    "object",
    "objects",
    "box",
    "polygon",
    "system",
    "user",
    "assistant",
    "at",
    "from",
    "to",
    "with",
    "corners",
    "and",
    "the",
    "a",
    "an",
    "of",
    "in",
    "image",
]


def _corpus() -> list[str]:
    """Fixed training text: the wire format, the default prompts and the demo vocabulary."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    lines = [
        "You are an open-vocabulary object detector. Reply with one single-line JSON object and nothing "
        'else, shaped like {"object_1": {...}, "object_2": {...}}. Each entry has a short plain-English '
        '"desc" and exactly one geometry: "bbox_2d" as [x1, y1, x2, y2] with x1 ≤ x2 and y1 ≤ y2, or "poly" '
        "as one closed ring of [x, y] points that starts at the top-most (then left-most) vertex and goes "
        "clockwise. Write every coordinate as <|coord_N|> with N from 0 to 999. Put one space after every "
        "':' and ','. List objects top to bottom, then left to right, numbering from 1. If nothing is "
        'visible, reply {}. Use desc "unknown" for objects you cannot name.',
        "List every object in the image, top to bottom then left to right, as one JSON object whose entries "
        "hold a desc and one geometry written with coordinate tokens 0–999.",
        " ".join(DEMO_WORDS),
    ]
    for n in range(1, 64):
        for word in DEMO_WORDS[:16]:
            lines.append(
                f'{{"object_{n}": {{"desc": "{word}", "bbox_2d": ["", "", "", ""]}}, '
                f'"object_{n + 1}": {{"desc": "{word}", "poly": [["", ""], ["", ""], ["", ""]]}}}}'
            )
    lines += [f"{w} at {n}, {n + 7}" for n in range(0, 1000, 37) for w in DEMO_WORDS[:16]]
    return lines


def build_tokenizer(out_dir: Path):
    """Train the BPE tokenizer and save it (transformers format) into ``out_dir``; return it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in COORD_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(out_dir)
    for tk in COORD_TOKENS[:1] + COORD_TOKENS[-1:]:
        ids = fast.encode(tk, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"coord token {tk} encodes to {ids}; the builder is broken")
    return fast


def _recipe(preset: str, seed: int, tie: bool) -> dict:
    return {
        "recipe": RECIPE_VERSION,
        "preset": preset,
        "seed": seed,
        "tie_word_embeddings": tie,
        "arch": PRESETS[preset],
    }


@one_builder_at_a_time
def build_tiny_lm(
    out_dir: Path, seed: int = 0, preset: str = "tiny", tie_word_embeddings: bool = True
) -> Path:
    """Build (or keep, if already built with the same recipe) a tiny Qwen2 causal LM in ``out_dir``.

    Args:
        out_dir: target directory; created if missing.
        seed: torch seed for the random init (the tokenizer does not depend on it).
        preset: a key of ``PRESETS``.
        tie_word_embeddings: tie input and output embeddings (helps a tiny model learn to copy tokens).

    Returns:
        ``out_dir`` as an absolute path.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir).resolve()
    recipe = _recipe(preset, seed, tie_word_embeddings)
    if built_from(out_dir, recipe):
        return out_dir
    tmp = staging_dir(out_dir)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(tmp)
    vocab = -(-len(tok) // 64) * 64
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(
        vocab_size=vocab,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos,
        eos_token_id=eot,
        pad_token_id=eos,
        torch_dtype="float32",
        **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[eot, eos], pad_token_id=eos, bos_token_id=eos)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "build_info.json").write_text(json.dumps({"recipe_key": recipe_key(recipe), **recipe}, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    logger.info("built %s (%s, seed %d, vocab %d)", out_dir, preset, seed, vocab)
    return out_dir


COPY_ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2-copy"


@one_builder_at_a_time
def build_copy_pretrained(out_dir: Path, base_dir: Path, *, rebuild: bool = False) -> Path:
    """The demo's starting model: ``base_dir`` after generic copy pretraining (shipped asset or trained here).

    Raises:
        RuntimeError: the pretraining did not converge (the demo would then learn far too slowly).
    """
    out_dir = Path(out_dir).resolve()
    base_tok = (Path(base_dir) / "tokenizer.json").read_text()
    asset_ok = (COPY_ASSET / "model.safetensors").is_file() and (
        COPY_ASSET / "tokenizer.json"
    ).read_text() == base_tok
    if (
        (out_dir / "model.safetensors").is_file()
        and (out_dir / "tokenizer.json").read_text() == base_tok
        and not rebuild
    ):
        return out_dir
    tmp = staging_dir(out_dir)
    if asset_ok and not rebuild:
        shutil.copytree(COPY_ASSET, tmp)
    else:
        import torch
        from copy_pretrain import CopyPretrainConfig, copy_pretrain
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("copy-pretraining %s (about 10 min on 2 CPU cores)", base_dir)
        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(base_dir)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        report = copy_pretrain(
            model, tok, CopyPretrainConfig(seed=5), "cpu", on_log=lambda d: logger.info("%s", d)
        )
        if not report["converged"]:
            raise RuntimeError(f"copy pretraining did not converge: {report}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def build_all(out: Path, *, rebuild_copy: bool = False) -> dict[str, Path]:
    """Build every embedded model under ``out``; return name → directory."""
    base = build_tiny_lm(out / "tiny-qwen2", seed=0)
    return {
        "tiny-qwen2": base,
        "tiny-qwen2-seed1": build_tiny_lm(out / "tiny-qwen2-seed1", seed=1),
        "tiny-qwen2-copy": build_copy_pretrained(out / "tiny-qwen2-copy", base, rebuild=rebuild_copy),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/models"))
    parser.add_argument(
        "--rebuild-copy", action="store_true", help="re-run copy pretraining instead of the asset"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for name, path in build_all(args.out, rebuild_copy=args.rebuild_copy).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
