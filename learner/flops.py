"""Model FLOPs of a training micro-step and the model-FLOPs utilisation (MFU) of the learner
(docs/ALGORITHM.md#mfu).

The count is the usual one (PaLM's, appendix B), per component of the model and per token the component sees:

- a parameter matrix of N weights applied to n tokens costs ``2·N·n`` in the forward, ``2·N·n`` for the
  gradient of its input (only where a trainable parameter lies upstream, i.e. where the backward has to pass
  through it) and ``2·N·n`` for its weight gradient (only if trainable): ``6·N·n`` for a trained component,
  ``4·N·n`` for a frozen one that gradients pass through, ``2·N·n`` for a frozen one at the start of the
  model (a frozen vision tower under a trained language model);
- components and their tokens: the vision tower's blocks and patch embedding see every image PATCH (a 2 B
  Qwen3-VL has ~4 patches per image token), its mergers the merged tokens (patches / merge²), the language
  model's layers every token of the row, the LM head only the columns whose logits are computed
  (`stage2.loss.compact_logits`: the ones the losses read); embedding tables cost nothing (lookups);
- attention (scores and values, no parameters) is counted APART: causal within each segment for the language
  model (``4·H·D·L(L+1)/2`` per layer forward for a segment of L tokens, H query heads of size D), full within
  each image frame for the vision tower (``4·H·D·P²`` per block), ×3 for forward + backward where gradients
  pass through it;
- gradient checkpointing's re-run forward is NOT counted (model FLOPs, not hardware FLOPs).

MFU = model FLOPs per second per GPU / the GPU's dense bf16 peak (`PEAK_TFLOPS`, or the run's
`gpu_peak_tflops`); ``mfu_with_attn`` adds the attention FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PEAK_TFLOPS", "FlopModel", "StepFlops", "peak_tflops", "utilization"]

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
)
"""Dense (no sparsity) bf16 tensor-core peak in TFLOP/s by device-name substring, first match wins (so the
more specific names come first). Vendor datasheets; H100 means the SXM card (989.4)."""


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of one GPU: `override` (`gpu_peak_tflops`) if set, else the first
    `PEAK_TFLOPS` entry whose name is in `device_name` (as `torch.cuda.get_device_name()` spells it), else
    None (no MFU for an unknown device or a CPU)."""
    if override is not None:
        return float(override)
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return tflops
    return None


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-step (all on one rank).

    Attributes:
        model: parameter-matrix FLOPs (the 6·N-style count, see the module docstring).
        attention: attention score/value FLOPs, counted apart.
        tokens: language-model tokens of the micro-step (real, no padding).
    """

    model: float
    attention: float
    tokens: int


@dataclass(frozen=True)
class FlopModel:
    """Parameter counts and attention shapes of a model, split by what each part sees (module docstring).

    Attributes:
        vision_patch: vision-tower weights applied to each patch, and how many of them are trainable.
        vision_merged: merger weights applied to each merged token (same pair).
        lm_body: language-model weights applied to each token, embeddings excluded (same pair).
        lm_head: LM-head weights applied to each computed logit column (same pair).
        lm_attn: `(layers, query heads, head size)` of the language model.
        vision_attn: `(blocks, heads, head size)` of the vision tower, or None.
        merge: patches per merged vision token (spatial_merge_size²).
    """

    vision_patch: tuple[int, int]
    vision_merged: tuple[int, int]
    lm_body: tuple[int, int]
    lm_head: tuple[int, int]
    lm_attn: tuple[int, int, int]
    vision_attn: tuple[int, int, int] | None
    merge: int

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> FlopModel:
        """Counts `model`'s parameters by part (read `requires_grad` now: freeze first)."""
        base = model
        while hasattr(base, "module"):  # DDP / DeepSpeed engine wrappers
            base = base.module
        config = base.config
        text = getattr(config, "text_config", None) or config
        vision = getattr(config, "vision_config", None)
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        head_weight = head.weight if head is not None else None
        embedding_weights = {
            id(m.weight) for m in base.modules() if isinstance(m, torch.nn.Embedding) and hasattr(m, "weight")
        }
        counts = {k: [0, 0] for k in ("vision_patch", "vision_merged", "lm_body")}
        seen: set[int] = set()
        for name, p in base.named_parameters(remove_duplicate=False):
            if id(p) in seen or p is head_weight or id(p) in embedding_weights:
                continue
            seen.add(id(p))
            if ".visual." in f".{name}" or name.startswith("visual."):
                part = "vision_merged" if "merger" in name else "vision_patch"
            else:
                part = "lm_body"
            counts[part][0] += p.numel()
            counts[part][1] += p.numel() if p.requires_grad else 0
        lm_head = (0, 0)
        if head_weight is not None:
            lm_head = (head_weight.numel(), head_weight.numel() if head_weight.requires_grad else 0)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        vision_attn = None
        if vision is not None:
            v_heads = getattr(vision, "num_heads", None) or vision.num_attention_heads
            depth = getattr(vision, "depth", None) or vision.num_hidden_layers
            vision_attn = (depth, v_heads, vision.hidden_size // v_heads)
        merge = int(getattr(vision, "spatial_merge_size", 1) or 1) ** 2 if vision is not None else 1
        return cls(
            vision_patch=tuple(counts["vision_patch"]),
            vision_merged=tuple(counts["vision_merged"]),
            lm_body=tuple(counts["lm_body"]),
            lm_head=lm_head,
            lm_attn=(text.num_hidden_layers, heads, head_dim),
            vision_attn=vision_attn,
            merge=merge,
        )  # type: ignore[arg-type]

    @property
    def parameters(self) -> int:
        """Parameters counted (embedding tables excluded, a tied head once)."""
        return sum(p[0] for p in (self.vision_patch, self.vision_merged, self.lm_body, self.lm_head))

    def step(
        self,
        segment_lengths: Sequence[int],
        logit_columns: int,
        image_frames: Iterable[tuple[int, int]] = (),
    ) -> StepFlops:
        """FLOPs of one micro-step's forward + backward.

        Args:
            segment_lengths: tokens of each causal segment (a packed row's segments, or a padded batch's real
                row lengths).
            logit_columns: positions whose logits the LM head computes (all tokens with full logits).
            image_frames: per image (or video frame group) `(frames, patches per frame)`, e.g. from
                `image_grid_thw` rows `(t, h·w)`.
        """
        parts = ("vision_patch", "vision_merged", "lm_body", "lm_head")
        frames = [(int(t), int(p)) for t, p in image_frames]
        patches = sum(t * p for t, p in frames)
        tokens = {
            "vision_patch": patches,
            "vision_merged": patches / self.merge,
            "lm_body": sum(segment_lengths),
            "lm_head": logit_columns,
        }
        model = 0.0
        upstream_trainable = False  # parts in forward order: gradients pass a part if anything before trains
        for part in parts:
            total, trainable = getattr(self, part)
            n = tokens[part]
            through = upstream_trainable or trainable > 0
            model += 2.0 * total * n + (2.0 * total * n if upstream_trainable else 0.0) + 2.0 * trainable * n
            upstream_trainable = through
        layers, heads, head_dim = self.lm_attn
        lm_trains = self.lm_body[1] > 0 or self.vision_patch[1] > 0 or self.vision_merged[1] > 0
        causal_pairs = sum(length * (length + 1) / 2 for length in segment_lengths)
        attention = 4.0 * heads * head_dim * causal_pairs * layers * (3 if lm_trains else 1)
        if self.vision_attn is not None and frames:
            depth, v_heads, v_dim = self.vision_attn
            pairs = sum(t * p * p for t, p in frames)
            attention += 4.0 * v_heads * v_dim * pairs * depth * (3 if self.vision_patch[1] > 0 else 1)
        return StepFlops(model=model, attention=attention, tokens=int(sum(segment_lengths)))

    def batch_step(self, batch: object, columns: torch.Tensor | None) -> StepFlops:
        """`step` for a prepared micro-batch (`learner.batching.packed_batch.PackedBatch`) and the logit
        columns `forward_for_loss` kept (None: full logits)."""
        if getattr(batch, "cu_seqlens", None) is not None:
            lengths = batch.cu_seqlens.diff().tolist()  # type: ignore[attr-defined]
        elif getattr(batch, "attention_mask", None) is not None:
            lengths = batch.attention_mask.sum(dim=1).tolist()  # type: ignore[attr-defined]
        else:
            ids = batch.input_ids  # type: ignore[attr-defined]
            lengths = [ids.shape[1]] * ids.shape[0]
        rows = batch.input_ids.shape[0]  # type: ignore[attr-defined]
        cols = int(columns.numel()) * rows if columns is not None else int(sum(lengths))
        grid = getattr(batch, "mm_inputs", {}).get("image_grid_thw")
        frames = [(int(t), int(h) * int(w)) for t, h, w in grid.tolist()] if grid is not None else []
        return self.step([int(x) for x in lengths], cols, frames)


def utilization(sums: Mapping[str, float], seconds: float, gpus: int, peak: float | None) -> dict[str, float]:
    """Throughput metrics of a logging step from its global sums.

    Args:
        sums: `perf/tokens`, `perf/model_flops`, `perf/attn_flops` summed over micro-steps and ranks.
        seconds: the step's learner time (forward + backward, slowest rank).
        gpus: data-parallel ranks the sums came from.
        peak: one GPU's dense peak (TFLOP/s), or None (no MFU).

    Returns:
        `perf/tokens_per_s` (all ranks), `perf/tflops_per_gpu` (model FLOPs), `perf/attn_tflops_per_gpu` and,
        with a peak, `perf/mfu` and `perf/mfu_with_attn` (fractions of `peak`); empty when `seconds` ≤ 0.
    """
    if seconds <= 0 or gpus <= 0:
        return {}
    per_gpu = 1e12 * seconds * gpus
    out = {
        "perf/tokens_per_s": sums["perf/tokens"] / seconds,
        "perf/tflops_per_gpu": sums["perf/model_flops"] / per_gpu,
        "perf/attn_tflops_per_gpu": sums["perf/attn_flops"] / per_gpu,
    }
    if peak:
        out["perf/mfu"] = out["perf/tflops_per_gpu"] / peak
        out["perf/mfu_with_attn"] = (out["perf/tflops_per_gpu"] + out["perf/attn_tflops_per_gpu"]) / peak
    return out
