"""Build a tiny random Qwen3-VL model (vision tower included, ~1M parameters) offline, for the image-path tests.

The tokenizer and chat template are the embedded tiny LM's (`build_tiny_models.build_tokenizer`): Qwen chat and
vision special tokens plus the 1000 single-id coord tokens. The processor keeps image-token counts tiny
(64x64 → 4 image tokens, 128x96 → 12, at most 64), and the model satisfies every constraint listed in
notes/tiny_vlm_on_cpu.md (text head_dim 64, mrope sections summing to head_dim/2, deepstack index below the
vision depth, square position-embedding table, vision config matching the image processor).

Loading the result without torchvision needs the import shim in `scripts/vlm_shim/` on `PYTHONPATH` (every
process, vLLM's architecture-inspection subprocess included); the builder installs it in-process itself.

CLI: ``python scripts/build_tiny_vlm.py --out .cache/models`` writes ``.cache/models/tiny-qwen3-vl``.
Building is deterministic and idempotent: a directory already holding the same recipe is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SCRIPTS = Path(__file__).resolve().parent
SHIM_DIR = SCRIPTS / "vlm_shim"
"""Folder to put on `PYTHONPATH` so every process loads the torchvision-free shim."""
MODEL_NAME = "tiny-qwen3-vl"
RECIPE_VERSION = 1

TEXT_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # vLLM's CPU paged attention rejects 16
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,  # vLLM reads the text config's flag
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [12, 10, 10],  # sums to head_dim / 2
        "mrope_interleaved": True,
    },
)
VISION_CONFIG = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=1,  # vision head_dim 64
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=128,  # == text hidden_size
    num_position_embeddings=576,  # a perfect square (24 x 24), interpolated to any grid
    deepstack_visual_indexes=[0],  # < depth and len <= text layers
)
IMAGE_PROCESSOR = dict(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},  # min / max pixels
)


def _install_shim() -> None:
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    import tinyvlm_compat

    tinyvlm_compat.install()


def _recipe(seed: int) -> dict:
    import build_tiny_models

    return {
        "recipe": RECIPE_VERSION,
        "tokenizer_recipe": build_tiny_models.RECIPE_VERSION,
        "seed": seed,
        "text": TEXT_CONFIG,
        "vision": VISION_CONFIG,
        "image_processor": IMAGE_PROCESSOR,
    }


def _key(recipe: dict) -> str:
    return hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _build_processor(tmp: Path):
    """Tokenizer (shared with the tiny LM) + PIL image processor + real Qwen3-VL video processor, saved."""
    import build_tiny_models
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = build_tiny_models.build_tokenizer(tmp)
    image_processor = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=build_tiny_models.CHAT_TEMPLATE,
    )
    processor.save_pretrained(tmp)
    return tokenizer


def build_tiny_vlm(out_dir: Path, seed: int = 0) -> Path:
    """Build (or keep, if already built with the same recipe) the tiny Qwen3-VL model in ``out_dir``.

    Args:
        out_dir: target directory (created; replaced atomically when the recipe changed).
        seed: torch seed of the random init (the tokenizer does not depend on it).

    Returns:
        ``out_dir`` as an absolute path.
    """
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    _install_shim()
    import torch
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir).resolve()
    recipe = _recipe(seed)
    info_path = out_dir / "build_info.json"
    if info_path.exists() and json.loads(info_path.read_text()).get("recipe_key") == _key(recipe):
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = _build_processor(tmp)
    ids = {
        t: tokenizer.convert_tokens_to_ids(t)
        for t in (
            "<|image_pad|>",
            "<|video_pad|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|im_end|>",
            "<|endoftext|>",
        )
    }
    vocab = -(-len(tokenizer) // 64) * 64
    config = Qwen3VLConfig(
        text_config={**TEXT_CONFIG, "vocab_size": vocab, "dtype": "float32"},
        vision_config=VISION_CONFIG,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    eot, eos = ids["<|im_end|>"], ids["<|endoftext|>"]
    model.generation_config = GenerationConfig(eos_token_id=[eot, eos], pad_token_id=eos, bos_token_id=eos)
    model.save_pretrained(tmp, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / "build_info.json").write_text(
        json.dumps({"recipe_key": _key(recipe), "parameters": n_params, **recipe}, indent=1)
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    logger.info("built %s (seed %d, %d parameters, vocab %d)", out_dir, seed, n_params, vocab)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/models"), help="parent folder of the model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build_tiny_vlm(args.out / MODEL_NAME, seed=args.seed)
    print(f"{MODEL_NAME}: {path}")
    print(f"serve or load it with PYTHONPATH={SHIM_DIR} (torchvision-free import shim)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
