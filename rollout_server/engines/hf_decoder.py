"""`HfDecoder`: ONE transformers decoder behind both HF engines, the rollout server's `HfEngine`
(`rollout_server.engines.hf`) and the learner's colocated HF backend (`learner.rollout.colocate.hf`).

It owns the model, the prompt encoder (`shared_schemas.torch_common.prompts.MessageEncoder`, or the learner's
caching `PromptEncoder`: the same `encode`), the ids that end a rollout and the decode loop's call
(`hf_decode.decode_requests`: per-row seeds, so a row's tokens do not depend on its batch mates), and turns
the loop's rows into `InferResult`s. The engines keep what differs between them: how a request becomes
messages (the server's `resolve_prompt` and its 400s, the learner's `request_messages`), the length check's
wording, and what happens around a call (the server's worker thread and weight versions, the learner's
eval/train switch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollout_server.engines.hf_decode import RowOutput, VisionRow, decode_requests
from shared_schemas.infer import Choice, InferBatch, InferResult, resolve_seeds
from shared_schemas.torch_common.prompts import MessageEncoder

__all__ = ["EncodedRequest", "HfDecoder"]

EncodedRequest = tuple[list[int], VisionRow | None]
"""One request's prompt ids and, for an image prompt, its vision inputs (None: the text path)."""


class HfDecoder:
    """A transformers model with its prompt encoder and end-of-rollout ids (see the module docstring).

    Args:
        model: a causal LM or image-text-to-text model (the caller sets its mode).
        tokenizer: its tokenizer (decodes choices; `pad_token_id`, EOS and `<|im_end|>` ids).
        encoder: encodes chat messages (`MessageEncoder` or the learner's `PromptEncoder`); None = an
            uncached text-only `MessageEncoder` of `tokenizer`.
        batch_size: rows (request × completion) per left-padded decode call.
        default_seed: base seed when a batch carries neither `seeds` nor `request_config.seed`.
        no_eos: builds the error raised when the model defines no EOS id (each engine words its own).

    Raises:
        what `no_eos` returns: neither the generation config nor the tokenizer names an EOS id, and the
            tokenizer has no `<|im_end|>`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        encoder: Any | None = None,
        batch_size: int,
        default_seed: int,
        no_eos: Callable[[], Exception],
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.encoder = encoder if encoder is not None else MessageEncoder(tokenizer)
        self.batch_size = batch_size
        self.default_seed = default_seed
        self.eos_ids = _eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise no_eos()
        im_end = _token_id(tokenizer, "<|im_end|>")
        self.end_of_turn_id = im_end if im_end is not None else self.eos_ids[0]
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]

    def encode_messages(self, messages: list[dict[str, Any]], index: int) -> EncodedRequest:
        """Prompt ids and vision inputs of chat `messages` (the encoder's `encode`)."""
        prompt = self.encoder.encode(messages, index=index)
        if not prompt.mm_inputs:
            return list(prompt.ids), None  # a text prompt keeps the text path
        return list(prompt.ids), VisionRow(prompt.mm_inputs, prompt.rope_positions)

    def generate(
        self, batch: InferBatch, encoded: Sequence[EncodedRequest], *, version: int
    ) -> list[InferResult]:
        """`batch.request_config.n` completions of every request, as `InferResult`s tagged `version`.

        Args:
            batch: the batch (sampling parameters, seeds, first index, request ids).
            encoded: per request, its prompt ids and vision inputs (checked by the caller).
            version: the weight version the results report.
        """
        cfg = batch.request_config
        prompts = [ids for ids, _ in encoded]
        vision = [row for _, row in encoded]
        seeds = resolve_seeds(batch, self.default_seed)
        per_request = decode_requests(
            self.model,
            prompts,
            seeds,
            cfg,
            batch_size=self.batch_size,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            end_of_turn_id=self.end_of_turn_id,
            decode_text=self._decode,
            vision=vision if any(v is not None for v in vision) else None,
        )
        return [
            InferResult(
                index=batch.first_index + i,
                request_id=request.request_id,
                prompt_token_ids=prompts[i],
                choices=[self._choice(o) for o in per_request[i]],
                weight_version=version,
            )
            for i, request in enumerate(batch.infer_requests)
        ]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _choice(self, row: RowOutput) -> Choice:
        text = self._decode(row.token_ids)
        if row.stop_string is not None:
            text = text[: text.find(row.stop_string)]
        return Choice(
            token_ids=row.token_ids, text=text, finish_reason=row.finish_reason, logprobs=row.logprobs
        )


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Ids that end a rollout: the generation config's and tokenizer's EOS, plus `<|im_end|>` (may be
    empty)."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        for value in source if isinstance(source, list) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    im_end = _token_id(tokenizer, "<|im_end|>")
    if im_end is not None and im_end not in ids:
        ids.append(im_end)
    return ids


def _token_id(tokenizer: Any, token: str) -> int | None:
    value = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(value, int) or value == tokenizer.unk_token_id:
        return None
    return value
