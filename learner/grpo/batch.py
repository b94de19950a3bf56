"""Micro-batch tensors and per-token log-probs of GRPO completions (docs/ALGORITHM.md#grpo-loss).

Layout of a micro-batch of ``B`` completions (prompt ``P_i`` + completion ``C_i`` tokens,
``L_i = P_i + C_i``):

- ``input_ids``/``attention_mask`` ``[B, T]``, ``T = max L_i``, RIGHT-padded, so every real token keeps its
  natural position (no position ids needed; causal attention never sees the padding on the right);
- Qwen-VL policies (rows with M-RoPE positions): ``position_ids`` ``[4, B, T]`` — row 0 the text positions,
  rows 1–3 the prompt's M-RoPE positions continued over the completion from ``max + 1``
  (:func:`learner.batching.packed_batch.segment_rope_positions`, the layout of the stage-2 padded rows), and
  the vision tensors (``pixel_values``, ``image_grid_thw``) of the rows concatenated in row order (the model
  consumes images placeholder by placeholder, left to right, row by row); every completion of a prompt repeats
  its prompt's tensors;
- the model returns logits for the last ``logits_to_keep = T − min P_i + 1`` positions only; dropping the last
  one leaves ``K = T − min P_i`` predictions for the targets ``input_ids[:, min P_i:]``;
- ``completion_mask`` ``[B, K]`` marks the target columns holding completion ``i``'s tokens;
- ``server_logprobs``/``server_logprobs_mask`` ``[B, K]``: the sampling log-probs the server returned (mask 0
  where it returned none);
- ``advantages`` ``[B]`` and, when a reference is used, ``ref_logps`` ``[B, K]``.

Log-probs are those of the model's own distribution (temperature 1), like the server's returned sampling
log-probs (vLLM reports raw log-probs), so the importance-ratio metric compares like with like. On-policy
(one optimizer step per generation) the ratio in the loss is 1 whatever the temperature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from learner.batching.packed_batch import segment_rope_positions

__all__ = ["CompletionRow", "collate_rows", "completion_logps", "selective_log_softmax"]


@dataclass(frozen=True)
class CompletionRow:
    """One completion as the learner trains on it.

    Attributes:
        prompt_ids: the prompt ids the server conditioned on.
        completion_ids: the sampled ids (non-empty).
        server_logprobs: the server's log-prob per completion token, or None.
        advantage: ``A_i`` (§3.1).
        rope_positions: the prompt's 3-row M-RoPE positions (Qwen-VL), else None.
        mm_inputs: the prompt's vision tensors (``pixel_values``, ``image_grid_thw``); empty for text.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    server_logprobs: Sequence[float] | None
    advantage: float
    rope_positions: Sequence[Sequence[int]] | None = None
    mm_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)


def collate_rows(rows: Sequence[CompletionRow], pad_id: int) -> dict[str, torch.Tensor | int]:
    """Builds the micro-batch tensors described in the module docstring.

    Raises:
        ValueError: no rows, an empty prompt or completion, or server log-probs of the wrong length.
    """
    if not rows:
        raise ValueError("collate_rows needs at least one completion")
    for i, row in enumerate(rows):
        if not row.prompt_ids or not row.completion_ids:
            raise ValueError(
                f"completion {i}: prompt ({len(row.prompt_ids)}) and completion "
                f"({len(row.completion_ids)}) must both be non-empty"
            )
        if row.server_logprobs is not None and len(row.server_logprobs) != len(row.completion_ids):
            raise ValueError(
                f"completion {i}: {len(row.server_logprobs)} server log-probs for "
                f"{len(row.completion_ids)} tokens"
            )
    total = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    min_prompt = min(len(r.prompt_ids) for r in rows)
    keep = total - min_prompt
    batch = len(rows)
    input_ids = torch.full((batch, total), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, total), dtype=torch.long)
    completion_mask = torch.zeros((batch, keep), dtype=torch.float32)
    server = torch.zeros((batch, keep), dtype=torch.float32)
    server_mask = torch.zeros((batch, keep), dtype=torch.float32)
    for i, row in enumerate(rows):
        ids = [*row.prompt_ids, *row.completion_ids]
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        start = len(row.prompt_ids) - min_prompt
        stop = start + len(row.completion_ids)
        completion_mask[i, start:stop] = 1.0
        if row.server_logprobs is not None:
            server[i, start:stop] = torch.tensor(row.server_logprobs, dtype=torch.float32)
            server_mask[i, start:stop] = 1.0
    out: dict[str, torch.Tensor | int] = {}
    if any(r.rope_positions is not None for r in rows):
        out["position_ids"] = _mrope_position_ids(rows, total)
    out.update(_concat_mm(rows))
    return {
        **out,
        "input_ids": input_ids,
        "attention_mask": attention,
        "targets": input_ids[:, min_prompt:].clone(),
        "completion_mask": completion_mask,
        "logits_to_keep": keep + 1,
        "server_logprobs": server,
        "server_logprobs_mask": server_mask,
        "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float32),
    }


def _mrope_position_ids(rows: Sequence[CompletionRow], total: int) -> torch.Tensor:
    """``[4, B, T]``: text positions, then the 3 M-RoPE rows (padding keeps 0; never attended, never read)."""
    batch = len(rows)
    text = torch.arange(total, dtype=torch.long).unsqueeze(0).expand(batch, total)
    rope = torch.zeros((3, batch, total), dtype=torch.long)
    for i, row in enumerate(rows):
        length = len(row.prompt_ids) + len(row.completion_ids)
        prompt = row.rope_positions
        if prompt is None:
            prompt = [list(range(len(row.prompt_ids)))] * 3
        if len(prompt) != 3 or any(len(axis) != len(row.prompt_ids) for axis in prompt):
            raise ValueError(
                f"completion {i}: rope_positions must be 3 rows of {len(row.prompt_ids)} positions"
            )
        rope[:, i, :length] = torch.tensor(segment_rope_positions(prompt, length), dtype=torch.long)
    return torch.cat([text.unsqueeze(0), rope], dim=0).contiguous()


def _concat_mm(rows: Sequence[CompletionRow]) -> dict[str, torch.Tensor]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.mm_inputs if k not in keys]
    return {key: torch.cat([r.mm_inputs[key] for r in rows if key in r.mm_inputs], dim=0) for key in keys}


_MODEL_KEYS = ("position_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""Optional batch keys passed to the forward when present (M-RoPE positions and vision tensors)."""


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` per position, one row at a time (never a ``[B, K, V]`` float32 copy).

    Args:
        logits: ``[B, K, V]``.
        targets: ``[B, K]`` token ids.

    Returns:
        ``[B, K]`` float32 log-probs.
    """
    out = []
    for row_logits, row_targets in zip(logits, targets, strict=True):
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(out)


def completion_logps(model: nn.Module, batch: dict[str, torch.Tensor | int]) -> torch.Tensor:
    """``[B, K]`` log-probs of ``batch["targets"]`` under ``model`` (mask with ``completion_mask``)."""
    keep = int(batch["logits_to_keep"])
    extra = {key: batch[key] for key in _MODEL_KEYS if key in batch}
    outputs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logits_to_keep=keep,
        use_cache=False,
        **extra,
    )
    logits = outputs.logits[:, :-1, :]
    return selective_log_softmax(logits, batch["targets"])
