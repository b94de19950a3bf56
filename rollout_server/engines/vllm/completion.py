"""One completion through `AsyncLLM.generate`: collects ids, text, logprobs and the finish reason, and applies
the repeat-terminate guard as a per-step stop check (docs/ALGORITHM.md#repeat-guard, see `guard`).

Without the guard the request asks vLLM for its final output only (one message per completion, the
cheapest path); with the guard outputs are streamed as deltas so the guard can stop the request early.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_server.engines.vllm.guard import first_guard_cut
from rollout_server.errors import BadRequestError, EngineError, PromptTooLongError
from shared_schemas.infer import RepeatTerminateConfig
from shared_schemas.repeat_guard import needs_text

__all__ = ["Completion", "run_completion"]


@dataclass(frozen=True)
class Completion:
    """One finished completion of one request.

    Attributes:
        token_ids: sampled ids (guarded: `g[:n] + [end_of_turn_id]`).
        text: decoded text, special tokens skipped, stop strings cut; None when vLLM did not detokenize (the
            caller decodes `token_ids` off the event loop).
        finish_reason: `stop`, `length` or `repeat_terminate`.
        logprobs: raw logprob of every id (None unless requested).
        prompt_token_ids: the ids vLLM conditioned on (image placeholders expanded).
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[float] | None
    prompt_token_ids: list[int]


async def run_completion(
    llm: Any,
    engine_input: dict[str, Any],
    params: Any,
    request_id: str,
    *,
    index: int,
    lora: Any,
    guard: RepeatTerminateConfig | None,
    want_logprobs: bool,
    detokenize: bool,
    end_of_turn_id: int,
    decode: Callable[[list[int]], str],
) -> Completion:
    """Runs one vLLM request to its end (or until the guard fires) and returns what it produced.

    Args:
        llm: the `AsyncLLM`.
        engine_input: the `TokensPrompt` dict (ids, optional `multi_modal_data`).
        params: its `SamplingParams` (FINAL_ONLY without guard, DELTA with it).
        request_id: unique vLLM request id.
        index: the request's global index (named in errors).
        lora: a `LoRARequest` or None.
        guard: the enabled guard config, or None.
        want_logprobs: whether logprobs were requested.
        detokenize: whether `params` ask vLLM for text (else `Completion.text` is None).
        end_of_turn_id: id appended when the guard fires.
        decode: ids → text (special tokens skipped), as the HF engine decodes.

    Raises:
        PromptTooLongError / BadRequestError: vLLM rejected the request (400).
        EngineError: vLLM failed or ended the request without a finish reason.
    """
    from vllm.exceptions import VLLMValidationError

    state = _Stream(guard, end_of_turn_id, decode)
    try:
        # Closing the stream on exit aborts the vLLM request at once (guard cut, cancellation, error).
        async with contextlib.aclosing(
            llm.generate(engine_input, params, request_id, lora_request=lora)
        ) as stream:
            async for out in stream:
                done = state.add(out, want_logprobs)
                if done is not None:
                    return done  # the tokens after the cut are discarded
    except VLLMValidationError as exc:
        raise _validation_error(index, exc) from exc
    except (BadRequestError, EngineError):
        raise
    except Exception as exc:
        raise EngineError(f"request {index}: vLLM failed ({type(exc).__name__}: {exc})") from exc
    if state.finish is None or state.finish == "abort":
        raise EngineError(f"request {index}: vLLM ended the request without a finish reason ({state.finish})")
    text = state.text if detokenize else None
    return Completion(
        state.tokens, text, state.finish, state.logprobs if want_logprobs else None, state.prompt_ids
    )


class _Stream:
    """Accumulates the outputs of one request and runs the guard after each chunk."""

    def __init__(
        self, guard: RepeatTerminateConfig | None, end_of_turn_id: int, decode: Callable[[list[int]], str]
    ) -> None:
        self.guard = guard
        self.end_of_turn_id = end_of_turn_id
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs: list[float] = []
        self.eot_logprobs: list[float] = []
        self.finish: str | None = None
        self.prompt_ids: list[int] = []
        self.checked = 0
        self.texts: dict[int, str] = {0: ""}  # prefix length → text, for the last two chunks

    def add(self, out: Any, want_logprobs: bool) -> Completion | None:
        """Takes one `RequestOutput`; returns the guarded completion when the guard fires."""
        if out.prompt_token_ids is not None and not self.prompt_ids:
            self.prompt_ids = list(out.prompt_token_ids)
        o = out.outputs[0]
        self.finish = o.finish_reason
        if self.guard is None:  # FINAL_ONLY: this one output holds everything
            self.tokens, self.text = list(o.token_ids), o.text
            if want_logprobs:
                self.logprobs = sampled_logprobs(o.token_ids, o.logprobs)
            return None
        before = len(self.tokens)
        self.tokens.extend(o.token_ids)
        self.text += o.text
        self.texts = {n: t for n, t in self.texts.items() if n >= before}
        self.texts[len(self.tokens)] = self.text
        if want_logprobs:
            self.logprobs.extend(sampled_logprobs(o.token_ids, o.logprobs))
            self.eot_logprobs.extend(token_logprobs(self.end_of_turn_id, o.logprobs))
        # Before token n is chosen the guard looks at g[:n]: check every n whose token n exists (n < len), so
        # that step n's end-of-turn logprob is known; n == len waits for the next chunk (or never comes:
        # finished).
        stop = len(self.tokens)
        text_of = self._text_of if needs_text(self.guard) else None
        cut = first_guard_cut(self.tokens, self.checked, stop, self.guard, text_of)
        self.checked = max(self.checked, stop)
        if cut is None:
            return None
        ids = [*self.tokens[:cut], self.end_of_turn_id]
        lps = [*self.logprobs[:cut], self.eot_logprobs[cut]] if want_logprobs else None
        return Completion(ids, self.decode(ids), "repeat_terminate", lps, self.prompt_ids)

    def _text_of(self, n: int) -> str:
        if n in self.texts:
            return self.texts[n]
        return self.decode(self.tokens[:n])


def _position_logprob(step_logprobs: Any, position: int, token_id: int) -> float:
    """Logprob of `token_id` at one position of vLLM's logprobs (`FlatLogprobs` or a list of dicts)."""
    flat_ids = getattr(step_logprobs, "token_ids", None)
    if flat_ids is None:
        return float(step_logprobs[position][token_id].logprob)
    start, end = step_logprobs.start_indices[position], step_logprobs.end_indices[position]
    for k in range(start, end):
        if flat_ids[k] == token_id:
            return float(step_logprobs.logprobs[k])
    raise EngineError(f"vLLM reported no logprob for token {token_id} at position {position}")


def sampled_logprobs(token_ids: Sequence[int], step_logprobs: Any) -> list[float]:
    """The logprob of each sampled id from vLLM's per-position logprobs."""
    if step_logprobs is None or len(step_logprobs) != len(token_ids):
        raise EngineError("vLLM returned no (or misaligned) logprobs although they were requested")
    return [_position_logprob(step_logprobs, i, token) for i, token in enumerate(token_ids)]


def token_logprobs(token_id: int, step_logprobs: Any) -> list[float]:
    """The logprob of one fixed id at every position (requested through `logprob_token_ids`)."""
    return [_position_logprob(step_logprobs, i, token_id) for i in range(len(step_logprobs))]


def _validation_error(index: int, exc: Exception) -> BadRequestError:
    message = str(exc)
    if "maximum model length" in message or "longer than" in message:
        return PromptTooLongError(
            f"request {index}: {message}; shorten the prompt or raise server.vllm.max_model_len",
            detail={"index": index},
        )
    return BadRequestError(
        f"request {index}: vLLM rejected the request: {message}",
        type="invalid_request",
        detail={"index": index},
    )
