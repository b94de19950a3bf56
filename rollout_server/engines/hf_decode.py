"""A left-padded, KV-cached decode loop for transformers causal LMs with per-row seeds.

`transformers.generate` draws every row from one global RNG, so a row's samples would depend on which
other rows share its batch; here every row owns a `torch.Generator` seeded from its request seed, so
results do not depend on chunking or batch size. The loop also applies the wire contract's rules exactly:
`min_tokens`, `ignore_eos`, stop strings, the repeat-terminate guard and raw-logit logprobs (as vLLM v1
reports them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rollout_server.engines.decode_attention import GROUPED_DECODE_SDPA, decode_attention
from shared_schemas.infer import FinishReason, RequestConfig, completion_seed
from shared_schemas.repeat_guard import needs_text, should_terminate

__all__ = ["RowOutput", "choose_tokens", "decode_requests", "decode_rows", "filter_top_k_top_p"]


@dataclass
class RowOutput:
    """One finished sequence."""

    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None
    stop_string: str | None = None
    """The stop string that ended the sequence (the caller cuts the text there)."""


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) tokens outside the top-k and outside the top-p nucleus of each row.

    Args:
        logits: `(B, V)` temperature-scaled logits.
        top_k: keep the k largest (-1 = off).
        top_p: keep the smallest set whose probability reaches `top_p` (1.0 = off); never empty.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose_tokens(
    logits: torch.Tensor,
    cfg: RequestConfig,
    generators: Sequence[torch.Generator],
    seen: torch.Tensor,
    block_eos: torch.Tensor,
    eos_ids: Sequence[int],
) -> torch.Tensor:
    """Picks one token per row: repetition penalty, EOS blocking, then argmax or seeded sampling.

    Args:
        logits: `(B, V)` float32 raw logits of the last position.
        cfg: sampling parameters.
        generators: one CPU generator per row.
        seen: `(B, V)` bool, tokens present in prompt or output (repetition penalty).
        block_eos: `(B,)` bool, rows still below `min_tokens`.
        eos_ids: ids that end a sequence.

    Returns:
        `(B,)` int64 token ids.
    """
    if cfg.repetition_penalty != 1.0:
        p = cfg.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if eos_ids and bool(block_eos.any()):
        logits = logits.clone()
        logits[block_eos.nonzero(as_tuple=True)[0].unsqueeze(1), torch.tensor(list(eos_ids))] = float("-inf")
    if cfg.temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_top_k_top_p(logits / cfg.temperature, cfg.top_k, cfg.top_p), dim=-1).cpu()
    picks = [torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(probs.shape[0])]
    return torch.cat(picks).to(logits.device)


@torch.inference_mode()
def decode_rows(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    cfg: RequestConfig,
    *,
    pad_id: int,
    eos_ids: Sequence[int],
    end_of_turn_id: int,
    decode_text: Callable[[list[int]], str],
) -> list[RowOutput]:
    """Generates one completion per prompt in one left-padded batch.

    Args:
        model: a causal LM returning `logits` and `past_key_values`.
        prompts: prompt ids per row.
        seeds: one sampling seed per row.
        cfg: sampling parameters (`n` is handled by the caller: one row per completion).
        pad_id: id used for left padding and for finished rows.
        eos_ids: ids that end a sequence (unless `ignore_eos`).
        end_of_turn_id: id emitted when the repeat guard fires.
        decode_text: ids → text (stop strings and guard rule (c)).

    Returns:
        One `RowOutput` per prompt, in order.
    """
    device = next(model.parameters()).device
    with decode_attention(model, device):
        return _decode_rows(
            model,
            prompts,
            seeds,
            cfg,
            device=device,
            pad_id=pad_id,
            eos_ids=eos_ids,
            end_of_turn_id=end_of_turn_id,
            decode_text=decode_text,
        )


def _decode_rows(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    cfg: RequestConfig,
    *,
    device: torch.device,
    pad_id: int,
    eos_ids: Sequence[int],
    end_of_turn_id: int,
    decode_text: Callable[[list[int]], str],
) -> list[RowOutput]:
    batch, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    vocab = model.get_output_embeddings().weight.shape[0]
    penalize = cfg.repetition_penalty != 1.0
    seen = torch.zeros((batch if penalize else 0, vocab), dtype=torch.bool, device=device)
    if penalize:
        seen.scatter_(1, input_ids.clamp(max=vocab - 1), attention.bool())
    step_mask = _StepMask(model, attention, cfg.max_tokens)
    guard, eos_set = cfg.repeat_terminate, set(eos_ids)
    outputs: list[RowOutput | None] = [None] * batch
    generated: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    cache = None
    step_ids, step_pos, mask = input_ids, positions, attention
    for step in range(cfg.max_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        # Active rows have all generated `step` tokens, so the min_tokens rule is one flag (a CPU tensor:
        # no device sync).
        block_eos = torch.full((batch,), step < cfg.min_tokens)
        chosen = choose_tokens(logits, cfg, generators, seen, block_eos, eos_ids).tolist()
        reasons: list[tuple[int, FinishReason, str | None]] = []
        for i in range(batch):
            if outputs[i] is not None:
                chosen[i] = pad_id
                continue
            g = generated[i]
            token, reason, stop = chosen[i], None, None
            if guard is not None and should_terminate(
                g, decode_text(g) if needs_text(guard) else None, guard
            ):
                token, reason = end_of_turn_id, "repeat_terminate"
            g.append(token)
            chosen[i] = token
            if reason is None and token in eos_set and not cfg.ignore_eos:
                reason = "stop"
            if reason is None and cfg.stop:
                text = decode_text(g)
                stop = next((s for s in cfg.stop if s in text), None)
                reason = "stop" if stop is not None else None
            if reason is None and len(g) >= cfg.max_tokens:
                reason = "length"
            if reason is not None:
                reasons.append((i, reason, stop))
        step_ids = torch.tensor(chosen, dtype=torch.long).unsqueeze(1).to(device)
        if cfg.logprobs:
            # One gather and one transfer per step (not one per row).
            picked = torch.log_softmax(logits, dim=-1).gather(1, step_ids).squeeze(1).tolist()
            for i in range(batch):
                if outputs[i] is None:
                    logprobs[i].append(picked[i])
        for i, reason, stop in reasons:
            outputs[i] = RowOutput(generated[i], reason, logprobs[i] if cfg.logprobs else None, stop)
        if all(o is not None for o in outputs):
            break
        if penalize:
            seen.scatter_(1, step_ids.clamp(max=vocab - 1), True)
        mask = step_mask.next()
        step_pos = step_pos[:, -1:] + 1
    return [o for o in outputs if o is not None]


class _StepMask:
    """The attention mask of each decode step (one new query per row), built without per-step allocations.

    With no left padding in the batch the mask is None: one query at the end of the cache attends to every
    key, so nothing needs masking (and SDPA takes its unmasked kernels). With padding, and an `sdpa` or
    `eager` attention implementation, the mask is a `(B, 1, 1, kv_len)` view into one preallocated additive
    float buffer (0 = attend, dtype minimum = masked). Transformers returns 4D masks as-is, so its per-step
    mask construction (a measurable share of a launch-bound decode step at batch 32) is skipped; an additive
    mask also spares SDPA its per-layer bool-to-float conversion, and the buffer's row length is a multiple
    of 16 so the memory-efficient kernel takes the view without padding a copy. Any other implementation
    gets the growing 2D mask, as transformers expects.
    """

    _ALIGN = 16

    def __init__(self, model: torch.nn.Module, prompt_mask: torch.Tensor, max_new_tokens: int) -> None:
        batch, self._kv_len = prompt_mask.shape
        padded = bool((prompt_mask == 0).any())
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        four_d = implementation in ("sdpa", "eager", GROUPED_DECODE_SDPA)
        self._mode = "none" if not padded else "4d" if four_d else "2d"
        if self._mode == "none":
            return
        width = -(-(self._kv_len + max_new_tokens) // self._ALIGN) * self._ALIGN
        keep = torch.ones((batch, width), dtype=torch.bool, device=prompt_mask.device)
        keep[:, : self._kv_len] = prompt_mask.bool()
        if self._mode == "4d":
            dtype = next(model.parameters()).dtype
            additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
            self._buffer = additive.masked_fill(~keep, torch.finfo(dtype).min)[:, None, None, :]
        else:
            self._buffer = keep.long()

    def next(self) -> torch.Tensor | None:
        """The mask for the next step (one more key than the previous one)."""
        self._kv_len += 1
        return None if self._mode == "none" else self._buffer[..., : self._kv_len]


def decode_requests(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    cfg: RequestConfig,
    *,
    batch_size: int,
    pad_id: int,
    eos_ids: Sequence[int],
    end_of_turn_id: int,
    decode_text: Callable[[list[int]], str],
) -> list[list[RowOutput]]:
    """`cfg.n` completions per prompt, decoded in left-padded chunks of at most `batch_size` rows.

    Completion `j` of request `i` is seeded with `completion_seed(seeds[i], j)`, so results do not depend on
    `batch_size` (every row owns its generator). Returns, per prompt, its `n` outputs in order.
    """
    rows = [(i, completion_seed(seed, j)) for i, seed in enumerate(seeds) for j in range(cfg.n)]
    outputs: list[RowOutput] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outputs += decode_rows(
            model,
            [prompts[i] for i, _ in chunk],
            [seed for _, seed in chunk],
            cfg,
            pad_id=pad_id,
            eos_ids=eos_ids,
            end_of_turn_id=end_of_turn_id,
            decode_text=decode_text,
        )
    return [outputs[i * cfg.n : (i + 1) * cfg.n] for i in range(len(prompts))]
