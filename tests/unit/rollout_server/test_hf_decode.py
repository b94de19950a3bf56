"""Token choice of the HF decode loop: filters, penalties, EOS blocking, per-row seeds."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_server.engines.hf_decode import choose_tokens, filter_top_k_top_p
from shared_schemas.infer import RequestConfig

NEG = float("-inf")


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    out = filter_top_k_top_p(logits, 2, 1.0)
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG]]


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filter_top_k_top_p(probs.log(), -1, 0.8)
    kept = [not math.isinf(v) for v in out[0].tolist()]
    assert kept == [True, True, False, False]
    # the top token always survives even with a tiny top_p
    assert not math.isinf(filter_top_k_top_p(probs.log(), -1, 1e-6)[0, 0].item())


def test_filters_off_are_identity() -> None:
    logits = torch.randn(3, 7)
    assert torch.equal(filter_top_k_top_p(logits, -1, 1.0), logits)


def choose(logits: torch.Tensor, seeds: list[int], **cfg: object) -> list[int]:
    config = RequestConfig.model_validate({"max_tokens": 4, **cfg})
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    block = torch.zeros(logits.shape[0], dtype=torch.bool)
    return choose_tokens(logits, config, gens, seen, block, [0]).tolist()


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert choose(logits, [0, 0]) == [1, 0]


def test_sampling_depends_only_on_own_seed() -> None:
    logits = torch.zeros(1, 50)
    alone = [choose(logits, [s], temperature=1.0)[0] for s in (1, 2, 3)]
    together = choose(logits.repeat(3, 1), [1, 2, 3], temperature=1.0)
    assert together == alone
    assert len(set(choose(logits.repeat(8, 1), list(range(8)), temperature=1.0))) > 1


def test_sampling_follows_the_probabilities_and_never_picks_a_zero() -> None:
    """Over 4000 seeds the picked tokens' frequencies match softmax(logits) (within 4 sigma), and a token
    of probability 0 (a -inf logit) is never picked."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().unsqueeze(0)
    n = 4000
    picks = choose(logits.repeat(n, 1), list(range(n)), temperature=1.0)
    counts = torch.bincount(torch.tensor(picks), minlength=5).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert counts[4] == 0
    assert bool(((counts - probs.double()).abs() <= 4 * sigma + 1e-12).all()), counts.tolist()


def test_repetition_penalty_and_eos_block() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    config = RequestConfig(max_tokens=4, repetition_penalty=2.0)
    seen = torch.tensor([[False, True, False]])
    gens = [torch.Generator()]
    assert choose_tokens(logits, config, gens, seen, torch.tensor([False]), [9]).tolist() == [0]
    # eos id 0 blocked below min_tokens → the best other token wins (4.0 / 2 = 2.0 > 1.0)
    assert choose_tokens(logits, config, gens, seen, torch.tensor([True]), [0]).tolist() == [1]


@pytest.mark.parametrize("top_k", [1, 2])
def test_top_k_one_is_greedy_when_sampling(top_k: int) -> None:
    logits = torch.tensor([[0.0, 9.0, 8.9, 0.0]])
    picks = {choose(logits, [s], temperature=5.0, top_k=top_k)[0] for s in range(20)}
    assert picks <= {1, 2} and (top_k == 2 or picks == {1})


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_batch_tokens_and_logprobs_equal_teacher_forcing(tiny_model_dir, tiny_tokenizer, attn) -> None:
    """Left padding plus the preallocated step mask must not change a row: greedy tokens are the argmax of
    an unpadded teacher-forced forward over prompt + completion, and logprobs are its log-softmax."""
    from transformers import AutoModelForCausalLM

    from rollout_server.engines.hf_decode import decode_rows

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    texts = ["a", "the lamp and the dog", '{"object_1": ', "chair chair chair chair chair chair chair"]
    prompts = [tiny_tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) > 1
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = RequestConfig(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
    rows = decode_rows(
        model,
        prompts,
        list(range(len(prompts))),
        cfg,
        pad_id=0,
        eos_ids=[eos],
        end_of_turn_id=eos,
        decode_text=tiny_tokenizer.decode,
    )
    for prompt, row in zip(prompts, rows, strict=True):
        assert len(row.token_ids) == 6 and row.finish_reason == "length"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        assert row.token_ids == logits.argmax(-1).tolist()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(row.token_ids)[:, None]).squeeze(1)
        assert row.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_vision_rows_are_checked_and_text_rows_keep_the_text_path(tiny_model_dir, tiny_tokenizer) -> None:
    """`vision` of all-None rows decodes exactly like no `vision`; malformed image rows fail before any
    forward (their M-RoPE positions must be 3 rows of the prompt's length). The image path itself is tested on
    the tiny Qwen3-VL in tests/integration/test_colocate_hf_image.py."""
    from transformers import AutoModelForCausalLM

    from rollout_server.engines.hf_decode import VisionRow, decode_rows

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [tiny_tokenizer.encode(t) for t in ("a", "the lamp and the dog")]
    kwargs = {"pad_id": 0, "eos_ids": [], "end_of_turn_id": 0, "decode_text": tiny_tokenizer.decode}
    cfg = RequestConfig(max_tokens=4, temperature=1.0)
    plain = decode_rows(model, prompts, [1, 2], cfg, **kwargs)
    assert decode_rows(model, prompts, [1, 2], cfg, vision=[None, None], **kwargs) == plain
    with pytest.raises(ValueError, match="1 vision rows for 2 prompts"):
        decode_rows(model, prompts, [1, 2], cfg, vision=[None], **kwargs)
    bad_rope = VisionRow({"pixel_values": torch.zeros(4, 8)}, [[0, 1, 2]] * 2)
    with pytest.raises(ValueError, match=r"row 1: M-RoPE positions of shape \(2, 3\) for a \d+-token prompt"):
        decode_rows(model, prompts, [1, 2], cfg, vision=[None, bad_rope], **kwargs)
    mixed_keys = [
        VisionRow({"pixel_values": torch.zeros(4, 8)}),
        VisionRow({"image_grid_thw": torch.ones(1, 3)}),
    ]
    with pytest.raises(ValueError, match="image rows carry different vision inputs"):
        decode_rows(model, prompts, [1, 2], cfg, vision=mixed_keys, **kwargs)


@pytest.mark.parametrize(
    "guard",
    [
        {"min_new_tokens": 4, "max_consecutive_token_repeats": 3, "ngram_size": 0},
        {"min_new_tokens": 5, "max_consecutive_token_repeats": 0, "ngram_size": 2},
    ],
    ids=["repeat", "ngram"],
)
def test_repeat_guard_cuts_exactly_where_the_rule_fires(tiny_model_dir, tiny_tokenizer, guard) -> None:
    """The HF backend's guard (spec §20.4): the guarded run is the free run's first `n` tokens plus the
    end-of-turn id, where `n` is the first length at which the shared rule fires."""
    from transformers import AutoModelForCausalLM

    from rollout_server.engines.hf_decode import decode_rows
    from shared_schemas.infer import RepeatTerminateConfig
    from shared_schemas.repeat_guard import should_terminate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eot = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # A repetitive prompt makes the random tiny model (tied embeddings) fall into a loop within a few tokens.
    prompt = tiny_tokenizer.encode("<|coord_5|><|coord_5|><|coord_5|><|coord_5|>")
    cfg = RepeatTerminateConfig(enabled=True, **guard)

    def run(repeat_terminate: RepeatTerminateConfig | None) -> tuple[list[int], str]:
        request = RequestConfig(
            max_tokens=40, temperature=0.0, ignore_eos=True, repeat_terminate=repeat_terminate
        )
        (row,) = decode_rows(
            model,
            [prompt],
            [0],
            request,
            pad_id=0,
            eos_ids=[eot],
            end_of_turn_id=eot,
            decode_text=tiny_tokenizer.decode,
        )
        return row.token_ids, row.finish_reason

    free, _ = run(None)
    cut = next(n for n in range(len(free) + 1) if should_terminate(free[:n], None, cfg))  # the run loops
    assert run(cfg) == (free[:cut] + [eot], "repeat_terminate")
