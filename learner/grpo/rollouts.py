"""Generate requests and result grouping for GRPO (docs/ALGORITHM.md#grpo).

One generate request per prompt with ``n = num_generations``; request ``i`` of a round carries the global
prompt index ``first_index + i`` (its position in the step's generation batch, resample rounds continuing
after the regular round), the explicit per-request seed ``prompt_seed`` (the one seed rule of
``learner.rollout.seeds`` with micro-step 0) and the request id ``grpo-s<step>-p<prompt_index>``. A text
prompt is sent as its ``prompt_token_ids``; an image prompt as its ``messages`` with the image parts (the
server templates it and expands the images itself: expanded ids would be expanded a second time). Results are
matched back by index AND request id (a mismatch raises), never by position; each result must hold exactly
``n`` choices and return the prompt ids the learner encoded (for an image prompt: the server's expansion
equals the learner processor's, or the step fails naming both lengths).

Pure: no HTTP, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from learner.grpo.config.sections import GrpoConfig
from learner.grpo.data import PromptRow
from learner.rollout.seeds import request_seed
from shared_schemas.infer import FinishReason, InferBatch, InferRequest, InferResult, RequestConfig

__all__ = [
    "Completion",
    "GenerationError",
    "Group",
    "build_infer_batch",
    "group_results",
    "prompt_seed",
    "request_config",
    "request_id",
]


class GenerationError(RuntimeError):
    """The server's answer does not fit the request (wrong request id, choice count or prompt ids)."""


def prompt_seed(seed: int, global_step: int, prompt_index: int) -> int:
    """``(training.seed + global_step · 1_000_003 + prompt_index) & 0x7FFFFFFF``: the one per-request seed
    rule (``learner.rollout.seeds.request_seed``) with micro-step 0: every request of a GRPO step, resample
    rounds included, has its own prompt index."""
    if global_step < 0 or prompt_index < 0:
        raise ValueError(f"global_step {global_step} and prompt_index {prompt_index} must be >= 0")
    return request_seed(seed, global_step, 0, prompt_index)


def request_id(global_step: int, prompt_index: int) -> str:
    """The id of the request for ``prompt_index`` at ``global_step`` (unique within a run)."""
    return f"grpo-s{global_step}-p{prompt_index}"


def request_config(grpo: GrpoConfig, *, logprobs: bool = True) -> RequestConfig:
    """The sampling config of every GRPO request: ``n = num_generations`` and the §3 sampling knobs.

    ``logprobs`` asks the server for the sampling log-probs (kept for the importance-ratio metric).
    """
    return RequestConfig(
        n=grpo.num_generations,
        max_tokens=grpo.max_completion_length,
        temperature=grpo.temperature,
        top_p=grpo.top_p,
        top_k=grpo.top_k if grpo.top_k is not None else -1,
        repetition_penalty=grpo.repetition_penalty,
        logprobs=logprobs,
    )


def build_infer_batch(
    rows: Sequence[PromptRow],
    *,
    global_step: int,
    first_index: int,
    seed: int,
    config: RequestConfig,
) -> InferBatch:
    """One request per prompt (text: ``prompt_token_ids``; images: ``messages``), global indices from
    ``first_index``, explicit seeds."""
    indices = range(first_index, first_index + len(rows))
    return InferBatch(
        infer_requests=[
            _request(row, request_id(global_step, i)) for row, i in zip(rows, indices, strict=True)
        ],
        request_config=config,
        first_index=first_index,
        seeds=[prompt_seed(seed, global_step, i) for i in indices],
    )


def _request(row: PromptRow, rid: str) -> InferRequest:
    if row.has_images:
        return InferRequest(messages=row.messages, request_id=rid)
    return InferRequest(prompt_token_ids=list(row.prompt_ids), request_id=rid)


def _prompt_mismatch(want: str, row: PromptRow, server_ids: Sequence[int]) -> str:
    if not row.has_images:
        return (
            f"result {want}: the server conditioned on {len(server_ids)} prompt ids that differ from the "
            f"{len(row.prompt_ids)} sent; server and learner must load the same tokenizer"
        )
    first = next(
        (k for k, (a, b) in enumerate(zip(server_ids, row.prompt_ids, strict=False)) if a != b),
        min(len(server_ids), len(row.prompt_ids)),
    )
    return (
        f"result {want} (row {row.row_id!r}, {row.n_images} image(s)): the server expanded the prompt to "
        f"{len(server_ids)} ids, the learner's processor to {len(row.prompt_ids)} (first difference at "
        f"position {first}); server and learner must load the same processor and image pixel bounds "
        "(server.vllm.mm_processor_kwargs, the checkpoint's preprocessor_config.json)"
    )


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: sampled ids (may end with the end-of-turn id).
        text: the server's decoded text (rewards read it).
        finish_reason: ``length`` marks a truncated completion.
        logprobs: the server's sampling log-prob per token, when returned.
    """

    token_ids: list[int] = field(repr=False)
    text: str
    finish_reason: FinishReason
    logprobs: list[float] | None = field(default=None, repr=False)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Group:
    """The ``G`` completions of one prompt, and their rewards once scored.

    Attributes:
        prompt_index: position in the step's generation batch (seed and request id derive from it).
        row: the prompt.
        completions: ``G`` completions in choice order.
        rewards: total reward per completion (§3.6); empty until scored.
        per_reward: raw value of every configured reward per completion.
        weight_version: the server weight version that produced the completions.
    """

    prompt_index: int
    row: PromptRow
    completions: list[Completion]
    weight_version: int = 0
    rewards: list[float] = field(default_factory=list)
    per_reward: dict[str, list[float]] = field(default_factory=dict)


def group_results(
    batch: InferBatch, results: Sequence[InferResult], rows: Sequence[PromptRow], *, global_step: int
) -> list[Group]:
    """Groups server results by prompt: ``out[i]`` answers ``rows[i]`` (prompt index ``first_index + i``).

    Args:
        batch: the batch that was sent (from :func:`build_infer_batch`).
        results: the results in any order.
        rows: the prompts of ``batch``, in request order.
        global_step: the step the batch was built for (request ids embed it).

    Raises:
        GenerationError: a missing, extra or duplicated result, a request id that does not name its prompt,
            a choice count other than ``n``, or prompt ids other than the learner's encoding (for an image
            prompt: the server's expansion differs from the learner processor's).
    """
    n = batch.request_config.n
    first = batch.first_index
    if len(rows) != len(batch.infer_requests):
        raise GenerationError(f"{len(rows)} rows for a batch of {len(batch.infer_requests)} requests")
    by_index: dict[int, InferResult] = {}
    for result in results:
        if result.index in by_index:
            raise GenerationError(f"result index {result.index} received twice")
        by_index[result.index] = result
    expected = set(range(first, first + len(rows)))
    if set(by_index) != expected:
        missing = sorted(expected - set(by_index))[:10]
        extra = sorted(set(by_index) - expected)[:10]
        raise GenerationError(f"results do not answer the batch: missing indices {missing}, extra {extra}")
    groups = []
    for offset, row in enumerate(rows):
        index = first + offset
        result = by_index[index]
        want = request_id(global_step, index)
        if result.request_id != want:
            raise GenerationError(
                f"result index {index} carries request_id {result.request_id!r}, expected {want!r}"
            )
        if len(result.choices) != n:
            raise GenerationError(f"result {want} holds {len(result.choices)} choices, requested n={n}")
        if list(result.prompt_token_ids) != list(row.prompt_ids):
            raise GenerationError(_prompt_mismatch(want, row, result.prompt_token_ids))
        completions = [
            Completion(
                list(c.token_ids),
                c.text,
                c.finish_reason,
                list(c.logprobs) if c.logprobs is not None else None,
            )
            for c in result.choices
        ]
        groups.append(
            Group(prompt_index=index, row=row, completions=completions, weight_version=result.weight_version)
        )
    return groups
