"""Wire models of `POST /infer/` (docs/ARCHITECTURE.md#infer) and the per-request seed rule
(docs/ARCHITECTURE.md#determinism).

The request side is a superset of the ms-swift rollout request, so a learner written for `swift rollout`
can send its requests unchanged: request models are tolerant readers (`extra="ignore"`; ignored key names
are logged once). Results are frozen.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_TOKENS_CAP",
    "SEED_MASK",
    "COMPLETION_SEED_STRIDE",
    "Choice",
    "FinishReason",
    "InferBatch",
    "InferRequest",
    "InferResponse",
    "InferResult",
    "RepeatTerminateConfig",
    "RequestConfig",
    "Timing",
    "image_ref_kind",
    "iter_image_refs",
    "completion_seed",
    "request_seed",
    "resolve_seeds",
]

MAX_TOKENS_CAP = 1 << 20
"""Upper bound of `max_tokens`: far above any real context, low enough to reject garbage early."""

SEED_MASK = 0x7FFFFFFF
"""Per-request seeds are kept in 31 bits (docs/ALGORITHM.md#seeds), which every backend accepts."""

FinishReason = Literal["stop", "length", "repeat_terminate"]

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
_IMAGE_KEYS = ("image", "image_url")
_warned_ignored: set[tuple[str, str]] = set()


def _log_ignored_once(model: str, data: Any, known: set[str]) -> None:
    """Logs (once per model and key) the keys a tolerant reader drops."""
    if not isinstance(data, dict):
        return
    for key in data:
        if key not in known and (model, key) not in _warned_ignored:
            _warned_ignored.add((model, key))
            logger.info("%s: ignoring unknown key %r (tolerant reader)", model, key)


class _TolerantModel(BaseModel):
    """Base of request models: unknown keys are dropped and logged once."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _note_ignored(cls, data: Any) -> Any:
        _log_ignored_once(cls.__name__, data, set(cls.model_fields))
        return data


def image_ref_kind(ref: str) -> Literal["path", "file", "data"]:
    """Classifies an image reference string.

    Args:
        ref: a local path, a `file://` URL or a `data:` URL.

    Returns:
        `"path"`, `"file"` or `"data"`.

    Raises:
        ValueError: empty string, or a URL scheme other than `file` and `data` (the server never fetches
            from the network).
    """
    if not ref:
        raise ValueError("empty image reference; send a local path, a file:// URL or a data: URL")
    if ref.startswith("data:"):
        return "data"
    if ref.startswith("file://"):
        return "file"
    match = _URL_SCHEME.match(ref)
    # A one-letter "scheme" is a Windows drive letter (C:\...), i.e. a path.
    if match and len(match.group(1)) > 1:
        raise ValueError(
            f"unsupported image URL scheme {match.group(1)!r};"
            " send a local path, a file:// URL or a data: URL"
        )
    return "path"


def iter_image_refs(messages: list[dict[str, Any]] | None) -> list[str]:
    """Returns the image reference strings found in chat message content parts, in order.

    A content part holds an image when it has an `image` or `image_url` key (`{"type": "image",
    "image": ...}`, or OpenAI style `{"type": "image_url", "image_url": {"url": ...}}`).
    """
    refs: list[str] = []
    for message in messages or []:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            for key in _IMAGE_KEYS:
                value = part.get(key)
                if isinstance(value, dict):
                    value = value.get("url")
                if isinstance(value, str):
                    refs.append(value)
                    break
    return refs


def _check_message(i: int, message: Any) -> None:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{i}].role must be a non-empty string")
    content = message.get("content")
    if content is None or not isinstance(content, str | list):
        raise ValueError(f"messages[{i}].content must be a string or a list of content parts")


class InferRequest(_TolerantModel):
    """One prompt: chat `messages` (plus optional `images`) or ready `prompt_token_ids`, never both."""

    messages: list[dict[str, Any]] | None = None
    """Chat messages; image parts carry path | file:// | data: URL strings."""
    images: list[str] = Field(default_factory=list)
    """Image reference strings in prompt order (ms-swift style), in addition to images inside messages."""
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Exact prompt ids (already templated); alternative to `messages`."""
    request_id: str | None = Field(default=None, max_length=256)
    """Opaque id echoed back in the result."""

    @model_validator(mode="after")
    def _check(self) -> InferRequest:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of 'messages' and 'prompt_token_ids' must be given")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("'messages' is empty; send at least one user message")
            for i, message in enumerate(self.messages):
                _check_message(i, message)
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("'prompt_token_ids' is empty; send at least one token id")
        for ref in [*self.images, *iter_image_refs(self.messages)]:
            image_ref_kind(ref)
        return self

    def all_image_refs(self) -> list[str]:
        """Image references of this request: those in `messages` first, then `images` not already there."""
        in_messages = iter_image_refs(self.messages)
        return in_messages + [ref for ref in self.images if ref not in in_messages]


class RepeatTerminateConfig(_TolerantModel):
    """Degenerate-rollout guard knobs (docs/ALGORITHM.md#repeat-guard)."""

    enabled: bool = False
    """Turns the guard on."""
    min_new_tokens: int = Field(default=256, ge=0)
    """The guard never fires before this many generated tokens."""
    max_consecutive_token_repeats: int = Field(default=64, ge=0)
    """Rule (a): fire when the last r tokens are one id (0 = off)."""
    ngram_size: int = Field(default=64, ge=0)
    """Rule (b): block length s (0 = off)."""
    ngram_repeats: int = Field(default=2, ge=0)
    """Rule (b): fire when the last s*m tokens are m identical blocks (m < 2 = off)."""
    max_object_keys: int | None = Field(default=None, ge=1)
    """Rule (c): fire when the text holds more than K occurrences of `"object_` (None = off)."""


class RequestConfig(_TolerantModel):
    """Sampling parameters shared by every request of one batch (docs/ARCHITECTURE.md#infer)."""

    n: int = Field(default=1, ge=1, le=256)
    """Completions per request."""
    max_tokens: int = Field(default=512, ge=1, le=MAX_TOKENS_CAP)
    """New tokens per completion; prompt + max_tokens must fit the server's max_model_len."""
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    """0 → argmax; > 0 samples."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass in (0, 1]."""
    top_k: int = Field(default=-1, ge=-1)
    """-1 = off, else >= 1."""
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    """> 0; 1.0 = off."""
    stop: list[str] | None = None
    """Stop strings (not included in the returned text); a single string is accepted."""
    seed: int | None = Field(default=None, ge=0)
    """Base seed; per-request seed = request_seed(seed, global index) unless the batch gives `seeds`."""
    logprobs: bool = False
    """Return the log-probability of every sampled token."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""
    min_tokens: int = Field(default=0, ge=0)
    """Minimum new tokens before EOS/stop may end a completion."""
    repeat_terminate: RepeatTerminateConfig | None = None
    """Degenerate-rollout guard (docs/ALGORITHM.md#repeat-guard); None = off."""
    adapter: str | None = Field(default=None, min_length=1, max_length=128)
    """Name of an adapter synced with mode `adapter`; None = the base (or fully synced) weights."""

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> RequestConfig:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")
        return self


class InferBatch(_TolerantModel):
    """Body of `POST /infer/`: requests, one shared config and the global index of the first request."""

    infer_requests: list[InferRequest]
    """Prompts; results[i] answers infer_requests[i]."""
    request_config: RequestConfig = Field(default_factory=RequestConfig)
    """Sampling parameters for every request."""
    first_index: int = Field(default=0, ge=0)
    """Global index of infer_requests[0]; result i has index first_index + i."""
    seeds: list[Annotated[int, Field(ge=0, le=SEED_MASK)]] | None = None
    """Explicit per-request seeds (same length as infer_requests); override the derivation."""

    @model_validator(mode="after")
    def _check(self) -> InferBatch:
        if self.seeds is not None and len(self.seeds) != len(self.infer_requests):
            raise ValueError(
                f"'seeds' has {len(self.seeds)} entries but there are {len(self.infer_requests)} requests;"
                " send one seed per request or none"
            )
        return self

    def slice(self, start: int, stop: int) -> InferBatch:
        """Returns the sub-batch `[start, stop)` with its global `first_index` and seeds preserved."""
        # Derived seeds depend only on (seed, global index), so shifting first_index preserves them.
        seeds = self.seeds[start:stop] if self.seeds is not None else None
        return InferBatch(
            infer_requests=self.infer_requests[start:stop],
            request_config=self.request_config,
            first_index=self.first_index + start,
            seeds=seeds,
        )


class Choice(BaseModel):
    """One completion."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    token_ids: list[int]
    """Exact sampled ids, no padding; may end with the end-of-turn id."""
    text: str
    """Decoded text (logging only; never re-tokenize it)."""
    finish_reason: FinishReason
    """`stop`, `length` (hit max_tokens) or `repeat_terminate`."""
    logprobs: list[float] | None = None
    """Log-probability of each token in `token_ids` (only when requested)."""


class InferResult(BaseModel):
    """Answer to one request."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    index: int = Field(ge=0)
    """Global index (first_index + position in the batch)."""
    request_id: str | None = None
    """Echo of the request's id."""
    prompt_token_ids: list[int]
    """Exact ids the engine conditioned on (templated, image placeholders as the engine saw them)."""
    choices: list[Choice]
    """`n` completions."""
    weight_version: int = Field(ge=0)
    """Weight version that produced this result."""


class Timing(BaseModel):
    """Server-side durations of one `/infer/` call, in seconds."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    total_s: float = Field(ge=0.0)
    """From request parsed to response built."""
    engine_s: float = Field(ge=0.0)
    """Inside the engine's generate."""


class InferResponse(BaseModel):
    """Body of a successful `POST /infer/`."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    results: list[InferResult]
    """results[i] answers infer_requests[i]."""
    weight_version: int = Field(ge=0)
    """Server weight version when the response was built."""
    timing: Timing
    """Server-side durations."""


def request_seed(base_seed: int, global_index: int) -> int:
    """Per-request sampling seed, independent of how a batch is chunked.

    `(base_seed + global_index) & 0x7FFFFFFF`: the learner folds step and micro-step into `base_seed`
    (docs/ALGORITHM.md#seeds: `training.seed + global_step * 1_000_003 + micro_idx * 10_007`) and the
    global request index arrives as `first_index + i`, so the spec formula is reproduced exactly.

    Args:
        base_seed: batch seed (>= 0).
        global_index: the request's global index (>= 0).

    Returns:
        A seed in [0, 2**31 - 1].
    """
    if base_seed < 0 or global_index < 0:
        raise ValueError(f"base_seed {base_seed} and global_index {global_index} must be >= 0")
    return (base_seed + global_index) & SEED_MASK


COMPLETION_SEED_STRIDE = 0x9E3779B1
"""Seed offset between the `n` completions of one request (golden-ratio stride: no collisions nearby)."""


def completion_seed(request_seed: int, j: int) -> int:
    """Seed of completion `j` (0-based) of a request whose seed is `request_seed`; every backend uses it."""
    return (request_seed + j * COMPLETION_SEED_STRIDE) & SEED_MASK


def resolve_seeds(batch: InferBatch, default_seed: int = 0) -> list[int]:
    """Seeds for every request of `batch`: explicit `seeds`, else derived from the config seed.

    Args:
        batch: the batch.
        default_seed: base seed used when the request config has none (the server's `seed`).

    Returns:
        One seed per request, in order.
    """
    if batch.seeds is not None:
        return list(batch.seeds)
    base = batch.request_config.seed if batch.request_config.seed is not None else default_seed
    return [request_seed(base, batch.first_index + i) for i in range(len(batch.infer_requests))]
