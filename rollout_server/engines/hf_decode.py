"""A left-padded, KV-cached decode loop for transformers causal LMs (and Qwen-VL models) with per-row seeds.

`transformers.generate` draws every row from one global RNG, so a row's samples would depend on which
other rows share its batch; here every row owns a `torch.Generator` seeded from its request seed, so
results do not depend on chunking or batch size. The loop also applies the wire contract's rules exactly:
`min_tokens`, `ignore_eos`, stop strings, the repeat-terminate guard and raw-logit logprobs (as vLLM v1
reports them).

Image prompts (a Qwen-VL model; rows carry a `VisionRow`): the ids are the processor-expanded ones (one
`<|image_pad|>` per image token). The prefill passes the vision tensors of the batch's image rows,
concatenated in row order (`pixel_values`, `image_grid_thw`, ...: the model scatters image features into the
placeholders in row-major order, so row order is placeholder order), and 4-row position ids `[4, B, L]`:
row 0 the 1-D text positions used for text prompts (the model reads it for its masks), rows 1-3 each row's
M-RoPE positions (time, height, width, as the model's `get_rope_index` computes them; left padding gets 0).
Transformers takes 4-row position ids as given, so it neither needs `mm_token_type_ids` nor keeps its own
`rope_deltas` state between calls. Decode step `k` continues all three M-RoPE rows at
`max(prompt rope positions) + 1 + k` (what `generate` does through `rope_deltas`). Text rows of a mixed
batch get their text positions in all rows; a batch without images keeps the plain text path (2-D position
ids), so text-only models and prompts decode exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rollout_server.engines.decode_attention import GROUPED_DECODE_SDPA, decode_attention
from shared_schemas.infer import FinishReason, RequestConfig, completion_seed
from shared_schemas.repeat_guard import needs_text, should_terminate

__all__ = ["RowOutput", "VisionRow", "choose_tokens", "decode_requests", "decode_rows", "filter_top_k_top_p"]


@dataclass
class RowOutput:
    """One finished sequence."""

    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None
    stop_string: str | None = None
    """The stop string that ended the sequence (the caller cuts the text there)."""


@dataclass(frozen=True)
class VisionRow:
    """The vision side of one image prompt (a `learner.data.prompt_encoding.EncodedPrompt`'s).

    Attributes:
        mm_inputs: the processor's vision tensors of the prompt (`pixel_values`, `image_grid_thw`, ...).
        rope_positions: ``[3][len(prompt)]`` M-RoPE positions of the prompt (rows t, h, w), or None for a
            model with 1-D positions.
    """

    mm_inputs: Mapping[str, torch.Tensor]
    rope_positions: Sequence[Sequence[int]] | None = None


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
        generators: one generator per row, on the device of `logits`.
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
    probs = torch.softmax(filter_top_k_top_p(logits / cfg.temperature, cfg.top_k, cfg.top_p), dim=-1)
    # torch.multinomial's own draw for one sample (an exponential race: argmax of p / Exp(1)), written out so
    # that it runs where the probabilities are, each row from its own seeded generator on that device. On the
    # host it cost 4 ms per row and step for a 151 k vocabulary: 0.6 s of an 8-row, 8-token H100 decode whose
    # GPU work was 0.06 s. On the CPU it is the same computation as before, so CPU results are unchanged.
    races = torch.stack(
        [torch.empty_like(probs[i]).exponential_(generator=g) for i, g in enumerate(generators)]
    )
    return torch.argmax(probs / races, dim=-1)


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
    vision: Sequence[VisionRow | None] | None = None,
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
        vision: per row, its images (`VisionRow`) or None for a text row; None = a text-only batch.

    Returns:
        One `RowOutput` per prompt, in order.
    """
    if vision is not None and len(vision) != len(prompts):
        raise ValueError(f"{len(vision)} vision rows for {len(prompts)} prompts")
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
            vision=vision,
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
    vision: Sequence[VisionRow | None] | None,
) -> list[RowOutput]:
    batch, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    mm_inputs, rope = _vision_batch(vision, prompts, positions)
    prefill_pos = positions if rope is None else torch.cat([positions[None], rope.positions])
    input_ids, attention, prefill_pos = input_ids.to(device), attention.to(device), prefill_pos.to(device)
    rope_delta = None if rope is None else rope.delta.to(device)
    text_pos = positions[:, -1:].to(device)
    generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
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
    step_ids, step_pos, mask = input_ids, prefill_pos, attention
    extra = {k: v.to(device) for k, v in mm_inputs.items()}
    for step in range(cfg.max_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        cache, extra = out.past_key_values, {}
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
        text_pos = text_pos + 1
        step_pos = text_pos if rope_delta is None else _step_rope_positions(text_pos, rope_delta)
    return [o for o in outputs if o is not None]


@dataclass
class _RopeBatch:
    positions: torch.Tensor
    """`(3, B, L)` left-padded M-RoPE prefill positions (pads 0)."""
    delta: torch.Tensor
    """`(B, 1)`: a row's M-RoPE position minus its text position after the prompt
    (``max(prompt rope positions) + 1 - len(prompt)``; 0 for text rows)."""


def _vision_batch(
    vision: Sequence[VisionRow | None] | None, prompts: Sequence[Sequence[int]], positions: torch.Tensor
) -> tuple[dict[str, torch.Tensor], _RopeBatch | None]:
    """The prefill's vision tensors (image rows concatenated in row order) and M-RoPE positions.

    Returns `({}, None)` for a batch without images (the text path). The M-RoPE positions are None when no
    image row carries them (a model with 1-D positions); text rows then get their text positions.
    """
    rows = [v for v in vision or () if v is not None and v.mm_inputs]
    if not rows:
        return {}, None
    keys = list(rows[0].mm_inputs)
    if any(list(v.mm_inputs) != keys for v in rows):
        raise ValueError(f"image rows carry different vision inputs (expected {keys} in every row)")
    mm_inputs = {k: torch.cat([v.mm_inputs[k] for v in rows]) for k in keys}
    if all(v.rope_positions is None for v in rows):
        return mm_inputs, None
    assert vision is not None
    batch, width = positions.shape
    rope = positions[None].repeat(3, 1, 1)
    delta = torch.zeros((batch, 1), dtype=torch.long)
    for i, (row, prompt) in enumerate(zip(vision, prompts, strict=True)):
        if row is None or row.rope_positions is None:
            continue
        own = torch.tensor([list(r) for r in row.rope_positions], dtype=torch.long)
        if own.shape != (3, len(prompt)):
            raise ValueError(
                f"row {i}: M-RoPE positions of shape {tuple(own.shape)} for a {len(prompt)}-token prompt;"
                f" expected (3, {len(prompt)})"
            )
        rope[:, i, width - len(prompt) :] = own
        delta[i, 0] = int(own.max()) + 1 - len(prompt)
    return mm_inputs, _RopeBatch(rope, delta)


def _step_rope_positions(text_pos: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`(4, B, 1)` position ids of a decode step: the text position, then the M-RoPE position in rows 1-3."""
    return torch.cat([text_pos[None], (text_pos + delta)[None].expand(3, -1, -1)])


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
    vision: Sequence[VisionRow | None] | None = None,
) -> list[list[RowOutput]]:
    """`cfg.n` completions per prompt, decoded in left-padded chunks of at most `batch_size` rows.

    Completion `j` of request `i` is seeded with `completion_seed(seeds[i], j)`, so results do not depend on
    `batch_size` (every row owns its generator). `vision` gives, per prompt, its images or None (see
    `decode_rows`). Returns, per prompt, its `n` outputs in order.
    """
    rows = [(i, completion_seed(seed, j)) for i, seed in enumerate(seeds) for j in range(cfg.n)]
    outputs: list[RowOutput] = []
    # Eager even where the learner compiled the model's blocks (`model.compile_blocks`): the compiled graphs
    # are the packed training forward's; a KV-cache decode of every length would only recompile them.
    with torch.compiler.set_stance("force_eager"):
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
                vision=None if vision is None else [vision[i] for i, _ in chunk],
            )
    return [outputs[i * cfg.n : (i + 1) * cfg.n] for i in range(len(prompts))]
