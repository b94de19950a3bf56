"""`ColocateRolloutSource` with the `hf` backend on the real tiny Qwen2 (docs/ALGORITHM.md#rollout §5.1–§5.3).

Generation with the training model itself: results in request order, prompt ids equal to the chat template,
per-request seeds make greedy (and sampled) results independent of the padded batch size and of the batch
composition, the model's training mode is restored (also after an error), a sync is a no-op that still
reports, and an empty batch never touches the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.rollout.colocate import ColocateRolloutSource
from learner.rollout.colocate.hf import HfColocateBackend
from learner.weights.types import WeightUpdate
from shared_schemas.infer import InferBatch, InferRequest, RequestConfig
from shared_schemas.torch_common.prompts import encode_chat_prompt

SYSTEM = {"role": "system", "content": "You are an open-vocabulary object detector."}
PROMPTS = [
    [SYSTEM, {"role": "user", "content": "List every object in the image."}],
    [{"role": "user", "content": "hello"}],
    [SYSTEM, {"role": "user", "content": 'Reply with one JSON object: {"object_1": <|coord_12|>'}],
    [SYSTEM, {"role": "user", "content": "a lamp, a dog and a chair " * 3}],
    [{"role": "user", "content": "x"}],
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def make_source(model: torch.nn.Module, tokenizer, batch_size: int, **kwargs) -> ColocateRolloutSource:
    return ColocateRolloutSource(HfColocateBackend(model, tokenizer, batch_size=batch_size, **kwargs))


def batch_of(indices: list[int], *, temperature: float = 0.0, first_index: int = 0) -> InferBatch:
    """Requests for PROMPTS[indices], each with a seed that depends only on the prompt (not the position)."""
    return InferBatch(
        infer_requests=[InferRequest(messages=PROMPTS[i], request_id=f"p{i}") for i in indices],
        request_config=RequestConfig(max_tokens=MAX_TOKENS, temperature=temperature),
        first_index=first_index,
        seeds=[1000 + 7 * i for i in indices],
    )


def tokens(results) -> dict[str, list[int]]:
    return {r.request_id: r.choices[0].token_ids for r in results}


def test_results_in_request_order_with_global_indices(model, tiny_tokenizer):
    source = make_source(model, tiny_tokenizer, batch_size=2)
    order = [3, 0, 4, 1, 2]
    results = source.infer(batch_of(order, first_index=17))
    assert [r.request_id for r in results] == [f"p{i}" for i in order]
    assert [r.index for r in results] == list(range(17, 22))
    for r in results:
        assert len(r.choices) == 1
        choice = r.choices[0]
        assert 1 <= len(choice.token_ids) <= MAX_TOKENS
        assert choice.finish_reason in ("stop", "length")
        assert (choice.finish_reason == "length") == (len(choice.token_ids) == MAX_TOKENS)
    assert source.endpoints == ("colocate:hf",)


def test_prompt_ids_are_the_chat_template(model, tiny_tokenizer):
    results = make_source(model, tiny_tokenizer, batch_size=4).infer(batch_of([0, 1, 2]))
    assistant = tiny_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for r, i in zip(results, [0, 1, 2], strict=True):
        expected = tiny_tokenizer.apply_chat_template(PROMPTS[i], tokenize=True, add_generation_prompt=True)
        expected = expected if isinstance(expected, list) else expected["input_ids"]
        assert r.prompt_token_ids == list(expected)
        # The server's rendering (template text, tokenized without extra specials) gives the same ids.
        assert r.prompt_token_ids == encode_chat_prompt(tiny_tokenizer, PROMPTS[i])
        assert r.prompt_token_ids[-len(assistant) :] == assistant


def test_prompt_token_ids_requests_are_used_verbatim(model, tiny_tokenizer):
    ids = encode_chat_prompt(tiny_tokenizer, PROMPTS[1])
    batch = InferBatch(
        infer_requests=[InferRequest(prompt_token_ids=ids, request_id="raw")],
        request_config=RequestConfig(max_tokens=MAX_TOKENS),
        seeds=[1007],
    )
    raw = make_source(model, tiny_tokenizer, batch_size=1).infer(batch)[0]
    via_messages = make_source(model, tiny_tokenizer, batch_size=1).infer(batch_of([1]))[0]
    assert raw.prompt_token_ids == ids
    assert raw.choices[0].token_ids == via_messages.choices[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_results_do_not_depend_on_batch_size_or_composition(model, tiny_tokenizer, temperature):
    everything = list(range(len(PROMPTS)))
    reference = tokens(
        make_source(model, tiny_tokenizer, 1).infer(batch_of(everything, temperature=temperature))
    )
    for batch_size in (2, 3, 5):
        got = tokens(
            make_source(model, tiny_tokenizer, batch_size).infer(
                batch_of(everything, temperature=temperature)
            )
        )
        assert got == reference, f"batch size {batch_size}"
    # Other neighbours and another order (left-padding widths change) give the same tokens per request.
    subset = tokens(make_source(model, tiny_tokenizer, 4).infer(batch_of([4, 2, 0], temperature=temperature)))
    assert subset == {k: reference[k] for k in subset}


def test_greedy_equals_transformers_generate(model, tiny_tokenizer):
    result = make_source(model, tiny_tokenizer, 2).infer(batch_of([0, 2]))
    for r in result:
        prompt = torch.tensor([r.prompt_token_ids])
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tiny_tokenizer.pad_token_id or 0,
            )
        want = out[0, prompt.shape[1] :].tolist()
        assert r.choices[0].token_ids == want[: len(r.choices[0].token_ids)]


@pytest.mark.parametrize("training", [True, False], ids=["train-mode", "eval-mode"])
def test_training_mode_restored_and_no_grad(model, tiny_tokenizer, training):
    model.train(training)
    model.zero_grad(set_to_none=True)
    make_source(model, tiny_tokenizer, 2).infer(batch_of([0, 1]))
    assert model.training is training
    assert all(p.grad is None for p in model.parameters())
    # An error inside the decode loop (an id outside the vocabulary) still restores the mode.
    vocab = model.get_input_embeddings().weight.shape[0]
    bad = InferBatch(
        infer_requests=[InferRequest(prompt_token_ids=[1, vocab + 5], request_id="bad")],
        request_config=RequestConfig(max_tokens=2),
    )
    with pytest.raises(IndexError):
        make_source(model, tiny_tokenizer, 1).infer(bad)
    assert model.training is training
    model.eval()


def test_sync_is_a_noop_that_reports_and_versions_results(model, tiny_tokenizer):
    source = make_source(model, tiny_tokenizer, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert source.health().weight_version == 0

    def never_read():
        raise AssertionError("the hf backend must not consume the update's tensors")
        yield  # pragma: no cover

    specs = tuple(WeightUpdate(mode="full", version=1, tensors={"w": torch.zeros(2)}).tensor_specs())
    report = source.sync_weights(WeightUpdate(mode="full", version=3, tensors=never_read(), specs=specs))
    assert (report.mode, report.version, report.bytes, report.transport) == ("full", 3, 0, "in_process")
    assert report.endpoints == ("colocate:hf",)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    results = source.infer(batch_of([0]))
    assert results[0].weight_version == 3
    assert source.last_staleness == [0]
    health = source.health()
    assert (health.status, health.engine, health.weight_version, health.lora_enabled) == (
        "ok",
        "hf",
        3,
        False,
    )


def test_empty_batch_never_touches_the_model(model, tiny_tokenizer):
    source = make_source(model, tiny_tokenizer, 2)
    assert source.infer(InferBatch(infer_requests=[])) == []
    assert source.backend.decode_calls == 0


def test_batches_are_split_by_rollout_generate_batch_size(model, tiny_tokenizer):
    source = make_source(model, tiny_tokenizer, 2)
    source.infer(batch_of([0, 1, 2, 3, 4]))
    assert (source.backend.decode_calls, source.backend.rows_decoded) == (3, 5)


@pytest.mark.parametrize(("batch_size", "warnings"), [(1, 1), (2, 0)])
def test_one_row_per_decode_call_is_named_once(model, tiny_tokenizer, caplog, batch_size, warnings):
    source = make_source(model, tiny_tokenizer, batch_size)
    with caplog.at_level("WARNING", logger="learner.rollout.colocate.hf"):
        source.infer(batch_of([0, 1]))
        source.infer(batch_of([2, 3]))
    named = [r for r in caplog.records if "rollout_generate_batch_size is 1" in r.getMessage()]
    assert len(named) == warnings
    assert all("set it to the rows per call (2)" in r.getMessage() for r in named)


def test_prompt_too_long_names_request_and_key(model, tiny_tokenizer):
    source = make_source(model, tiny_tokenizer, 2, max_model_len=30)
    with pytest.raises(
        ValueError,
        match=r"request 3: \d+ prompt \+ 10 new tokens > max_model_len 30.*rollout\.vllm\.max_model_len",
    ):
        source.infer(batch_of([4, 0], first_index=2))


def test_image_requests_are_refused_with_the_fix(model, tiny_tokenizer):
    batch = InferBatch(
        infer_requests=[
            InferRequest(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "hi"}],
                    }
                ]
            )
        ]
    )
    with pytest.raises(ValueError, match="rollout.backend 'vllm'"):
        make_source(model, tiny_tokenizer, 1).infer(batch)


def test_peft_model_generates_with_its_adapter(model, tiny_tokenizer):
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    source = make_source(peft_model, tiny_tokenizer, 2)
    assert source.health().lora_enabled
    base = tokens(make_source(model, tiny_tokenizer, 2).infer(batch_of([0, 2])))
    # LoRA B starts at zero: the adapter model answers exactly like the base model.
    assert tokens(source.infer(batch_of([0, 2]))) == base
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2.0)
    changed = tokens(source.infer(batch_of([0, 2])))
    assert changed != base  # the live adapter weights generate (no stale copy)
