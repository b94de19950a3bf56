"""Build tiny random Qwen3-VL models (with vision tower) offline: the image-path test model and the demo's.

The tokenizer and chat template are the embedded tiny LM's (`build_tiny_models.build_tokenizer`): Qwen chat
and vision special tokens plus the 1000 single-id coord tokens. The processor keeps image-token counts tiny
(64x64 → 4 image tokens, 128x96 → 12, at most 64), and the model satisfies every constraint vLLM's and
transformers' Qwen3-VL code checks on CPU (text head_dim 64, mrope sections summing to head_dim/2, deepstack
index below the vision depth, square position-embedding table, vision config matching the image processor).

Loading the result without torchvision needs the import shim in `shared_schemas/vlm_shim/` on `PYTHONPATH`
(every process, vLLM's architecture-inspection subprocess included); the builder installs it in-process
itself.

Presets (``PRESETS``): ``tiny-qwen3-vl`` is the image-path test model above; ``tiny-qwen3-vl-demo`` is the
image demo's model (5M parameters, 192x192 images → 36 image tokens), built twice: ``tiny-qwen3-vl-demo-init``
(random) and ``tiny-qwen3-vl-demo`` = its stage-1 SFT (``scripts/vlm_pretrain.py``), copied from the shipped
``assets/tiny-qwen3-vl-demo-stage1/`` and re-trained only when that asset is missing or no longer matches the
preset or the demo's prompts (``--rebuild-stage1`` forces it).

CLI: ``python scripts/build_tiny_vlm.py --out .cache/models`` writes ``.cache/models/tiny-qwen3-vl``;
``--preset tiny-qwen3-vl-demo`` writes ``tiny-qwen3-vl-demo-init`` and ``tiny-qwen3-vl-demo``.
Building is deterministic and idempotent: a directory already holding the same recipe (or asset) is kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository
from learner.demo_data.files import built_from, one_builder_at_a_time, recipe_key, staging_dir  # noqa: E402

logger = logging.getLogger(__name__)

SCRIPTS = Path(__file__).resolve().parent
SHIM_DIR = SCRIPTS.parent / "shared_schemas" / "vlm_shim"
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


@dataclass(frozen=True)
class VlmPreset:
    """One named architecture: text and vision configs plus the image processor that must match the vision."""

    text: dict
    vision: dict
    image_processor: dict


DEMO_MODEL_NAME = "tiny-qwen3-vl-demo"
DEMO_INIT_NAME = DEMO_MODEL_NAME + "-init"
"""The random-init demo model; ``DEMO_MODEL_NAME`` is the stage-1 model built from the shipped asset."""
CROWDED_MODEL_NAME = "tiny-qwen3-vl-crowded-init"
"""The random-init crowded-task model (its stage-1 is trained on a GPU, not shipped)."""
PRESETS: dict[str, VlmPreset] = {
    # The image-path test model: ~1M parameters, 64x64 -> 4 image tokens.
    # Tests pin its shape and token counts.
    MODEL_NAME: VlmPreset(TEXT_CONFIG, VISION_CONFIG, IMAGE_PROCESSOR),
    # The image demo model (5M parameters; 192x192 -> 12x12 patches -> 36 image tokens): 4 text layers of
    # width 256 and a 4-block vision tower of width 128 whose block 1 also feeds text layer 0 (deepstack).
    # Same tokenizer, rope layout and image processor as the test model; ~10 MB of weights in bf16.
    DEMO_MODEL_NAME: VlmPreset(
        text={
            **TEXT_CONFIG,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        vision={
            **VISION_CONFIG,
            "depth": 4,
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_heads": 2,
            "out_hidden_size": 256,
            "deepstack_visual_indexes": [1],
        },
        image_processor=IMAGE_PROCESSOR,
    ),
    # The crowded task's model (``learner.demo_data.images.CROWDED_CONFIG``: 384x384 -> 24x24 patches -> 144
    # image tokens): 6 text layers of width 384 and a 6-block vision tower of width 256 whose blocks 1 and 3
    # feed text layers 0 and 1 (deepstack); ~17M parameters, so that localisation is not the limit. Its
    # stage-1 is trained on a GPU by ``bench/crowded_stage1.sh`` (too large to ship: ~34 MB in bf16).
    CROWDED_MODEL_NAME: VlmPreset(
        text={
            **TEXT_CONFIG,
            "hidden_size": 384,
            "intermediate_size": 1024,
            "num_hidden_layers": 6,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
        },
        vision={
            **VISION_CONFIG,
            "depth": 6,
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_heads": 4,
            "out_hidden_size": 384,
            "deepstack_visual_indexes": [1, 3],
        },
        image_processor={**IMAGE_PROCESSOR, "size": {"shortest_edge": 32 * 32, "longest_edge": 448 * 448}},
    ),
}


def _install_shim() -> None:
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    import tinyvlm_compat

    tinyvlm_compat.install()


def _recipe(seed: int, preset: str) -> dict:
    import build_tiny_models

    arch = PRESETS[preset]
    recipe = {
        "recipe": RECIPE_VERSION,
        "tokenizer_recipe": build_tiny_models.RECIPE_VERSION,
        "seed": seed,
        "text": arch.text,
        "vision": arch.vision,
        "image_processor": arch.image_processor,
    }
    if preset != MODEL_NAME:  # the test model's recipe key predates presets and stays as it was
        recipe["preset"] = preset
    return recipe


def _build_processor(tmp: Path, image_processor_config: dict):
    """Tokenizer (shared with the tiny LM) + PIL image processor + real Qwen3-VL video processor, saved."""
    import build_tiny_models
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = build_tiny_models.build_tokenizer(tmp)
    image_processor = Qwen2VLImageProcessorPil(**image_processor_config)
    video_processor = Qwen3VLVideoProcessor(**image_processor_config)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=build_tiny_models.CHAT_TEMPLATE,
    )
    processor.save_pretrained(tmp)
    return tokenizer


@one_builder_at_a_time
def build_tiny_vlm(out_dir: Path, seed: int = 0, preset: str = MODEL_NAME) -> Path:
    """Build (or keep, if already built with the same recipe) a tiny random Qwen3-VL model in ``out_dir``.

    Args:
        out_dir: target directory (created; replaced atomically when the recipe changed).
        seed: torch seed of the random init (the tokenizer does not depend on it).
        preset: a key of ``PRESETS``.

    Returns:
        ``out_dir`` as an absolute path.
    """
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    _install_shim()
    import torch
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir).resolve()
    arch = PRESETS[preset]
    recipe = _recipe(seed, preset)
    if built_from(out_dir, recipe):
        return out_dir
    tmp = staging_dir(out_dir)
    tmp.mkdir(parents=True)
    tokenizer = _build_processor(tmp, arch.image_processor)
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
        text_config={**arch.text, "vocab_size": vocab, "dtype": "float32"},
        vision_config=arch.vision,
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
        json.dumps({"recipe_key": recipe_key(recipe), "parameters": n_params, **recipe}, indent=1)
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    logger.info("built %s (seed %d, %d parameters, vocab %d)", out_dir, seed, n_params, vocab)
    return out_dir


DEMO_ASSET = SCRIPTS.parent / "assets" / "tiny-qwen3-vl-demo-stage1"
"""The shipped stage-1 weights of the demo model (``scripts/vlm_pretrain.py``; recipe in its
pretrain_info.json)."""
DEMO_DATA = SCRIPTS.parent / ".cache" / "data" / "demo_vlm"


def _matches_preset(model_dir: Path, init_dir: Path) -> bool:
    """Same tokenizer as ``init_dir``, the demo preset's text and vision architecture, and stage-1 trained on
    the demo's prompts (``pretrain_info.json``; the learner rolls out with ``prompts:`` of
    configs/demo_vlm_cpu.yaml)."""
    from learner.demo_data.images import DEMO_SYSTEM_PROMPT, DEMO_USER_PROMPT

    if not (model_dir / "model.safetensors").is_file() or not (model_dir / "config.json").is_file():
        return False
    info = model_dir / "pretrain_info.json"
    recipe = json.loads(info.read_text()).get("config", {}) if info.is_file() else {}
    if (recipe.get("system_prompt"), recipe.get("user_prompt")) != (DEMO_SYSTEM_PROMPT, DEMO_USER_PROMPT):
        return False
    if (model_dir / "tokenizer.json").read_text() != (init_dir / "tokenizer.json").read_text():
        return False
    config = json.loads((model_dir / "config.json").read_text())
    arch = PRESETS[DEMO_MODEL_NAME]
    return all(config["text_config"].get(k) == v for k, v in arch.text.items()) and all(
        config["vision_config"].get(k) == v for k, v in arch.vision.items()
    )


@one_builder_at_a_time
def build_demo_stage1(out_dir: Path, init_dir: Path, *, rebuild: bool = False) -> Path:
    """The image demo's starting model: ``init_dir`` after stage-1 SFT, copied from ``DEMO_ASSET``.

    Only when the asset is missing or no longer matches the preset (or ``rebuild``) is the pretraining re-run
    here (``scripts/vlm_pretrain.py`` with its default recipe on the default demo data; minutes on a GPU,
    far longer on 2 CPU cores).
    """
    out_dir = Path(out_dir).resolve()
    asset_ok = _matches_preset(DEMO_ASSET, init_dir)
    if not rebuild and asset_ok and _matches_preset(out_dir, init_dir):
        if (out_dir / "model.safetensors").read_bytes() == (DEMO_ASSET / "model.safetensors").read_bytes():
            return out_dir
    tmp = staging_dir(out_dir)
    if asset_ok and not rebuild:
        shutil.copytree(DEMO_ASSET, tmp)
    else:
        import vlm_pretrain
        from build_vlm_demo_data import DEFAULT_N_EVAL, DEFAULT_N_TRAIN

        from learner.demo_data.images import write_image_dataset

        logger.info("stage-1 pretraining of %s (no usable asset in %s)", init_dir, DEMO_ASSET)
        write_image_dataset(DEMO_DATA, DEFAULT_N_TRAIN, DEFAULT_N_EVAL, seed=0)
        code = vlm_pretrain.main(["--model-dir", str(init_dir), "--data", str(DEMO_DATA), "--out", str(tmp)])
        if code != 0:
            raise RuntimeError(f"vlm_pretrain.py exited with {code}")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def build_demo_vlm(out: Path, seed: int = 0, *, rebuild: bool = False) -> dict[str, Path]:
    """The image demo models under ``out``: ``tiny-qwen3-vl-demo-init`` (random init, ``seed``) and
    ``tiny-qwen3-vl-demo`` (its stage-1 SFT, :func:`build_demo_stage1`)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    if str(SCRIPTS.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPTS.parent))
    init = build_tiny_vlm(out / DEMO_INIT_NAME, seed=seed, preset=DEMO_MODEL_NAME)
    return {
        DEMO_INIT_NAME: init,
        DEMO_MODEL_NAME: build_demo_stage1(out / DEMO_MODEL_NAME, init, rebuild=rebuild),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/models"), help="parent folder of the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=MODEL_NAME)
    parser.add_argument(
        "--rebuild-stage1",
        action="store_true",
        help="demo preset: re-run stage-1 pretraining instead of the asset",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.preset in (MODEL_NAME, CROWDED_MODEL_NAME):
        built = {args.preset: build_tiny_vlm(args.out / args.preset, seed=args.seed, preset=args.preset)}
    else:
        built = build_demo_vlm(args.out, seed=args.seed, rebuild=args.rebuild_stage1)
    for name, path in built.items():
        print(f"{name}: {path}")
    print(f"serve or load it with PYTHONPATH={SHIM_DIR} (torchvision-free import shim)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
