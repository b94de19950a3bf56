"""One vLLM completion driven by scripted `RequestOutput` streams (no engine): final-only results, the guard's
per-step stop check (exactly g[:n] + [eot], the eot logprob of step n) and vLLM error mapping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.logprobs import FlatLogprobs, Logprob

from rollout_server.engines.vllm.completion import run_completion, sampled_logprobs, token_logprobs
from rollout_server.errors import BadRequestError, EngineError, PromptTooLongError
from shared_schemas.infer import RepeatTerminateConfig

EOT = 2
PROMPT = [9, 9, 9]


def _flat(rows: list[dict[int, float]]) -> FlatLogprobs:
    flat = FlatLogprobs()
    for row in rows:
        flat.append({t: Logprob(logprob=lp) for t, lp in row.items()})
    return flat


def _out(tokens: list[int], finish: str | None, logprobs: Any = None, text: str = "") -> Any:
    choice = SimpleNamespace(token_ids=tokens, text=text, finish_reason=finish, logprobs=logprobs)
    return SimpleNamespace(prompt_token_ids=PROMPT, outputs=[choice])


class ScriptedLlm:
    """Yields scripted outputs; records whether the consumer stopped early (which aborts in vLLM)."""

    def __init__(self, outputs: list[Any], error: Exception | None = None) -> None:
        self.outputs = outputs
        self.error = error
        self.closed_early = False

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            if self.error is not None:
                raise self.error
            try:
                for out in self.outputs:
                    yield out
            except GeneratorExit:
                self.closed_early = True
                raise

        return stream()


def _run(
    llm: ScriptedLlm, guard: RepeatTerminateConfig | None, logprobs: bool = True, detokenize: bool = False
) -> Any:
    return asyncio.run(
        run_completion(
            llm,
            {"prompt_token_ids": PROMPT},
            None,
            "rid",
            index=5,
            lora=None,
            guard=guard,
            want_logprobs=logprobs,
            detokenize=detokenize,
            end_of_turn_id=EOT,
            decode=lambda ids: " ".join(map(str, ids)),
        )
    )


def test_final_only_output_is_taken_as_is() -> None:
    lps = _flat([{7: -0.5}, {8: -1.0}])
    done = _run(ScriptedLlm([_out([7, 8], "length", lps, "seven eight")]), None, detokenize=True)
    assert (done.token_ids, done.text, done.finish_reason, done.logprobs) == (
        [7, 8],
        "seven eight",
        "length",
        [-0.5, -1.0],
    )
    assert done.prompt_token_ids == PROMPT
    assert _run(ScriptedLlm([_out([7], "stop", _flat([{7: -0.1}]))]), None).text is None  # decoded later


def test_guard_cuts_at_the_first_firing_prefix_even_inside_a_chunk() -> None:
    guard = RepeatTerminateConfig(
        enabled=True, min_new_tokens=4, max_consecutive_token_repeats=3, ngram_size=0
    )
    rows = [
        {5: -0.1, EOT: -3.0},
        {6: -0.2, EOT: -3.1},
        {6: -0.3, EOT: -3.2},
        {6: -0.4, EOT: -3.3},
        {6: -0.5, EOT: -3.4},
    ]
    # Chunks [5] [6, 6, 6] [6] [6 ...]:
    # the guard fires before token 4 (g = 5 6 6 6), found when token 4 exists.
    llm = ScriptedLlm(
        [
            _out([5], None, _flat(rows[:1])),
            _out([6, 6, 6], None, _flat(rows[1:4])),
            _out([6], None, _flat(rows[4:5])),
            _out([6], "length", _flat([{6: -0.6, EOT: -3.5}])),
        ]
    )
    done = _run(llm, guard)
    assert done.token_ids == [5, 6, 6, 6, EOT] and done.finish_reason == "repeat_terminate"
    assert done.logprobs == [-0.1, -0.2, -0.3, -0.4, -3.4]  # eot's logprob at step 4
    assert done.text == "5 6 6 6 2" and llm.closed_early


def test_guard_may_replace_the_last_token_of_a_finished_request() -> None:
    guard = RepeatTerminateConfig(
        enabled=True, min_new_tokens=0, max_consecutive_token_repeats=2, ngram_size=0
    )
    done = _run(ScriptedLlm([_out([4, 4, 1], "length")]), guard, logprobs=False)
    assert done.token_ids == [4, 4, EOT] and done.logprobs is None


def test_guard_that_never_fires_returns_the_stream() -> None:
    guard = RepeatTerminateConfig(
        enabled=True, min_new_tokens=0, max_consecutive_token_repeats=3, ngram_size=0
    )
    done = _run(ScriptedLlm([_out([4], None), _out([5], None), _out([EOT], "stop")]), guard, logprobs=False)
    assert (done.token_ids, done.finish_reason) == ([4, 5, EOT], "stop")


def test_errors_are_mapped() -> None:
    too_long = VLLMValidationError(
        "The decoder prompt (length 5000) is longer than the maximum model length of 2048"
    )
    with pytest.raises(PromptTooLongError, match="request 5"):
        _run(ScriptedLlm([], too_long), None)
    with pytest.raises(BadRequestError, match="request 5: vLLM rejected"):
        _run(ScriptedLlm([], VLLMValidationError("Token id 99999 is out of vocabulary")), None)
    with pytest.raises(EngineError, match="request 5: vLLM failed"):
        _run(ScriptedLlm([], RuntimeError("boom")), None)
    with pytest.raises(EngineError, match="without a finish reason"):
        _run(ScriptedLlm([_out([1], "abort")]), None, logprobs=False)


def test_logprob_extraction_from_flat_and_dict_logprobs() -> None:
    rows = [{3: -1.0, EOT: -2.0}, {EOT: -0.5}]
    assert sampled_logprobs([3, EOT], _flat(rows)) == [-1.0, -0.5]
    assert token_logprobs(EOT, _flat(rows)) == [-2.0, -0.5]
    as_dicts = [{t: Logprob(logprob=lp) for t, lp in row.items()} for row in rows]
    assert sampled_logprobs([3, EOT], as_dicts) == [-1.0, -0.5]
    with pytest.raises(EngineError):
        sampled_logprobs([3], None)
