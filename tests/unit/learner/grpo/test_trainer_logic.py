"""The GRPO step logic around the trainer, with a fake rollout source (pure; no engine, no HF model).

Covers: requests (one per prompt, n = G, §1 seeds, request ids), grouping of results by prompt index via
request ids (any result order; wrong ids/counts raise), reward → advantage wiring over the generation batch,
dynamic sampling with bounded resample rounds (indices and seeds continue after the regular round), the
window assembly from slots dealt over ranks, and the micro-batch tensor layout.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from learner.grpo.advantages import compute_advantages
from learner.grpo.batch import CompletionRow, collate_rows
from learner.grpo.config.sections import GrpoConfig
from learner.grpo.data import GenerationSlots, PromptRow
from learner.grpo.generation import GroupGenerator, ResamplePool
from learner.grpo.rollouts import (
    GenerationError,
    build_infer_batch,
    group_results,
    prompt_seed,
    request_config,
    request_id,
)
from learner.grpo.window import SlotTag, WindowError, assemble_window, slot_tags
from shared_schemas.infer import Choice, InferBatch, InferResult

G = 4
HEADER = "<DOMAIN=BBU>, <TASK=SUMMARY>"
GOOD = HEADER + '\n{"统计": [{"类别": "A"}]}'
BAD = "garbage"


def make_row(index: int, domain: str = "BBU") -> PromptRow:
    return PromptRow(
        index=index,
        row_id=f"r{index}",
        messages=[{"role": "user", "content": f"prompt {index}"}],
        prompt_ids=[100 + index, 7, 8],
        reward_row={"task_mode": "summary", "domain": domain, "summary_ref": {"统计": [{"类别": "A"}]}},
    )


Texts = Callable[[int, int], str]
"""(prompt row index, choice j) → completion text."""


class FakeSource:
    """A `RolloutSource` answering each request with ``n`` choices from ``texts``; records every batch.

    Results are returned in a shuffled order when ``shuffle`` (the grouping must not rely on positions).
    """

    def __init__(self, texts: Texts, *, shuffle: bool = False, version: int = 3) -> None:
        self.texts = texts
        self.shuffle = shuffle
        self.version = version
        self.batches: list[InferBatch] = []

    @property
    def endpoints(self) -> tuple[str, ...]:
        return ("fake",)

    def infer(self, batch: InferBatch) -> list[InferResult]:
        self.batches.append(batch)
        results = []
        for i, request in enumerate(batch.infer_requests):
            ids = request.prompt_token_ids or [0]  # a messages request: the test sets the expanded ids
            row_index = ids[0] - 100
            choices = [
                Choice(
                    token_ids=[1, 2, j + 3],
                    text=self.texts(row_index, j),
                    finish_reason="stop",
                    logprobs=[-0.1] * 3,
                )
                for j in range(batch.request_config.n)
            ]
            results.append(
                InferResult(
                    index=batch.first_index + i,
                    request_id=request.request_id,
                    prompt_token_ids=ids,
                    choices=choices,
                    weight_version=self.version,
                )
            )
        if self.shuffle:
            random.Random(0).shuffle(results)
        return results

    def sync_weights(self, update):  # pragma: no cover - not used by the generator
        raise NotImplementedError

    def health(self):  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


def generator(
    source: FakeSource, rows: list[PromptRow], *, max_resample_times: int = 1, enabled: bool = True
):
    grpo = GrpoConfig(num_generations=G, max_completion_length=32, global_max_length=64)
    return GroupGenerator(
        source=source,
        config=request_config(grpo),
        reward_weights={"summary.format": 1.0, "summary.header": 2.0},
        schemas=None,
        seed=42,
        resample_pool=ResamplePool(rows, seed=42),
        dynamic_sample=enabled,
        max_resample_times=max_resample_times,
    )


# -- requests and grouping ---------------------------------------------------------------------------------
def test_one_request_per_prompt_with_n_seeds_and_ids() -> None:
    rows = [make_row(i) for i in range(3)]
    config = request_config(GrpoConfig(num_generations=G, temperature=0.9, max_completion_length=32))
    batch = build_infer_batch(rows, global_step=5, first_index=3, seed=42, config=config)
    assert batch.request_config.n == G and batch.request_config.temperature == 0.9
    assert batch.request_config.logprobs is True and batch.request_config.max_tokens == 32
    assert batch.first_index == 3
    assert [r.request_id for r in batch.infer_requests] == ["grpo-s5-p3", "grpo-s5-p4", "grpo-s5-p5"]
    assert batch.seeds == [(42 + 5 * 1_000_003 + p) & 0x7FFFFFFF for p in (3, 4, 5)]
    assert [r.prompt_token_ids for r in batch.infer_requests] == [row.prompt_ids for row in rows]


def test_seed_is_masked_to_31_bits() -> None:
    assert prompt_seed(2**31 - 1, 0, 1) == 0
    assert prompt_seed(0, 3000, 7) == (3000 * 1_000_003 + 7) & 0x7FFFFFFF


def test_results_are_grouped_by_prompt_index_whatever_their_order() -> None:
    rows = [make_row(i) for i in range(5)]
    source = FakeSource(lambda r, j: f"row{r}-choice{j}", shuffle=True)
    config = request_config(GrpoConfig(num_generations=G))
    batch = build_infer_batch(rows, global_step=2, first_index=0, seed=0, config=config)
    groups = group_results(batch, source.infer(batch), rows, global_step=2)
    assert [g.prompt_index for g in groups] == [0, 1, 2, 3, 4]
    for g, row in zip(groups, rows, strict=True):
        assert g.row is row
        assert [c.text for c in g.completions] == [f"row{row.index}-choice{j}" for j in range(G)]
        assert g.weight_version == 3


def _results(batch: InferBatch, **change) -> list[InferResult]:
    out = FakeSource(lambda r, j: "x").infer(batch)
    return [out[0].model_copy(update=change), *out[1:]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"request_id": "grpo-s9-p0"}, "expected 'grpo-s1-p0'"),
        ({"request_id": "grpo-s1-p1"}, "expected 'grpo-s1-p0'"),
        ({"index": 1}, "received twice"),
        ({"index": 7}, "missing indices [0]"),
        ({"prompt_token_ids": [1, 2]}, "differ"),
        ({"choices": []}, "0 choices, requested n=4"),
    ],
)
def test_grouping_rejects_answers_that_do_not_fit(change: dict, message: str) -> None:
    rows = [make_row(0), make_row(1)]
    batch = build_infer_batch(rows, global_step=1, first_index=0, seed=0, config=request_config(GrpoConfig()))
    with pytest.raises(GenerationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        group_results(batch, _results(batch, **change), rows, global_step=1)


def test_request_id_names_step_and_prompt() -> None:
    assert request_id(0, 0) == "grpo-s0-p0"
    assert request_id(12, 3) != request_id(1, 23)


# -- rewards → advantages ------------------------------------------------------------------------------------
def test_rewards_flow_into_group_major_advantages() -> None:
    rows = [make_row(0), make_row(1)]
    # prompt 0: choices 0 and 2 good (format 1 + header 2 = 3), others 0; prompt 1: only choice 3 good.
    good = {(0, 0), (0, 2), (1, 3)}
    source = FakeSource(lambda r, j: GOOD if (r, j) in good else BAD)
    out = generator(source, rows).generate_step(rows, global_step=0)
    assert [g.rewards for g in out.groups] == [[3.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 3.0]]
    assert out.groups[0].per_reward["summary.format"] == [1.0, 0.0, 1.0, 0.0]
    assert out.groups[0].per_reward["summary.header"] == [1.0, 0.0, 1.0, 0.0]
    assert out.first_round_rewards == [3.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 3.0]
    assert (out.requests, out.infer_calls, out.resample_rounds) == (2, 1, 0)
    rewards = torch.tensor([r for g in out.groups for r in g.rewards], dtype=torch.float64)
    adv = compute_advantages(rewards, G, estimator="grpo", scale_rewards="group")
    # group 0: mean 1.5, std sqrt(3); group 1: mean 0.75, std 1.5
    s0, s1 = 3**0.5 + 1e-4, 1.5 + 1e-4
    expected = [1.5 / s0, -1.5 / s0, 1.5 / s0, -1.5 / s0, -0.75 / s1, -0.75 / s1, -0.75 / s1, 2.25 / s1]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    # slot (p, j) trains on advantage p·G + j
    assert adv[SlotTag(0, 1, 3, 1).flat_index(G)].item() == pytest.approx(2.25 / s1)


# -- dynamic sampling ----------------------------------------------------------------------------------------
def test_zero_variance_group_is_resampled_with_continuing_indices_and_seeds() -> None:
    rows = [make_row(i) for i in range(6)]
    # prompt 2 always fails (zero variance); every other prompt: choice 0 good only.
    source = FakeSource(lambda r, j: BAD if r == 2 or j else GOOD)
    out = generator(source, rows).generate_step(rows[:3], global_step=4)
    assert len(source.batches) == 2  # regular round + one resample round
    regular, extra = source.batches
    assert regular.first_index == 0 and len(regular.infer_requests) == 3
    assert extra.first_index == 3 and len(extra.infer_requests) == 1
    assert extra.infer_requests[0].request_id == "grpo-s4-p3"
    assert extra.seeds == [prompt_seed(42, 4, 3)]
    drawn = ResamplePool(rows, seed=42).draw(4, 1, 1)[0]
    assert drawn.index == 1  # keyed draw (seed 42, step 4, round 1): a prompt with signal
    assert extra.infer_requests[0].prompt_token_ids == drawn.prompt_ids
    # kept groups in generation order, then the resampled one (prompt index 3)
    assert [(g.row.index, g.prompt_index) for g in out.groups] == [(0, 0), (1, 1), (1, 3)]
    assert out.groups[2].rewards == [3.0, 0.0, 0.0, 0.0]
    assert (out.zero_var_groups, out.resample_rounds, out.filled_with_zero_var) == (1, 1, 0)
    assert (out.requests, out.infer_calls) == (4, 2)
    assert out.first_round_rewards[8:] == [0.0] * G  # the dropped group still counts in the policy's view


def test_resampled_zero_variance_group_fills_the_slot_after_the_last_round() -> None:
    rows = [make_row(i) for i in range(4)]
    source = FakeSource(lambda r, j: GOOD if r == 0 and j == 0 else BAD)  # only prompt 0 has signal
    assert ResamplePool(rows, 42).draw(0, 1, 1)[0].index == 2  # the resample draws a zero-variance prompt
    out = generator(source, rows, max_resample_times=1).generate_step([rows[0], rows[1]], global_step=0)
    assert [(g.row.index, g.prompt_index) for g in out.groups] == [(0, 0), (2, 2)]
    assert out.groups[1].rewards == [0.0] * G
    assert (out.zero_var_groups, out.resample_rounds, out.filled_with_zero_var) == (1, 1, 1)
    assert out.dynamic_sample_metrics()["dynamic_sample/filled_with_zero_var"] == 1.0
    assert len(source.batches) == 2


def test_resample_rounds_are_bounded() -> None:
    rows = [make_row(i) for i in range(4)]
    source = FakeSource(lambda r, j: BAD)  # every group zero-variance
    out = generator(source, rows, max_resample_times=2).generate_step(rows[:2], global_step=1)
    assert out.resample_rounds == 2 and len(source.batches) == 3
    assert out.zero_var_groups == 2 and out.filled_with_zero_var == 2
    assert [b.first_index for b in source.batches] == [0, 2, 4]
    none = FakeSource(lambda r, j: BAD)
    out = generator(none, rows, enabled=False).generate_step(rows[:2], global_step=1)
    assert len(none.batches) == 1 and out.resample_rounds == 0 and out.zero_var_groups == 2


def test_resample_pool_is_keyed_by_step_and_round() -> None:
    rows = [make_row(i) for i in range(10)]
    pool = ResamplePool(rows, seed=1)
    assert [r.index for r in pool.draw(3, 1, 4)] == [
        r.index for r in ResamplePool(rows, seed=1).draw(3, 1, 4)
    ]
    assert len({r.index for r in pool.draw(3, 1, 4)}) == 4
    assert len(pool.draw(0, 1, 25)) == 25  # more than the prompt count: repeats allowed


# -- the window of a step, dealt over ranks ------------------------------------------------------------------
def deal(dataset: GenerationSlots, step: int, per_device: int, world: int) -> list[list[list[dict]]]:
    """Micro-batches per rank as accelerate deals a sequential sampler: batch b → rank b % world."""
    start = step * dataset.slots_per_step
    items = [dataset[i] for i in range(start, start + dataset.slots_per_step)]
    batches = [items[i : i + per_device] for i in range(0, len(items), per_device)]
    return [[b for k, b in enumerate(batches) if k % world == rank] for rank in range(world)]


@pytest.mark.parametrize(("per_device", "world"), [(16, 1), (8, 1), (4, 2), (2, 4), (1, 8), (2, 2)])
def test_window_is_the_same_whatever_rank_holds_which_slot(per_device: int, world: int) -> None:
    dataset = GenerationSlots(num_rows=10, prompts_per_step=4, num_generations=G, num_steps=3, seed=7)
    for step in range(3):
        per_rank = deal(dataset, step, per_device, world)
        assert all(per_rank)  # every rank holds some slots
        tags = [t for rank in per_rank for raw in rank for t in slot_tags(raw)]
        window = assemble_window(tags, prompts_per_step=4, num_generations=G)
        assert window == [dataset[step * 16 + p * G]["row"] for p in range(4)]
        assert sorted(t.flat_index(G) for t in tags) == list(range(16))


def test_slots_are_group_major_and_steps_contiguous() -> None:
    dataset = GenerationSlots(num_rows=5, prompts_per_step=2, num_generations=G, num_steps=3, seed=0)
    assert len(dataset) == 3 * 8
    items = [dataset[i] for i in range(len(dataset))]
    assert [(s["step"], s["prompt_slot"], s["generation"]) for s in items[:5]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 0, 2),
        (0, 0, 3),
        (0, 1, 0),
    ]
    rows = [items[s * 8 + p * G]["row"] for s in range(3) for p in range(2)]
    assert sorted(rows[:5]) == [0, 1, 2, 3, 4]  # one pass over the prompts before any repeats
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_incomplete_or_mixed_windows_are_rejected() -> None:
    tags = [SlotTag(0, p, j, p) for p in range(2) for j in range(G)]
    assert assemble_window(tags, prompts_per_step=2, num_generations=G) == [0, 1]
    with pytest.raises(WindowError, match="gathered 7 of its 8"):
        assemble_window(tags[:-1], prompts_per_step=2, num_generations=G)
    with pytest.raises(WindowError, match="dealt twice"):
        assemble_window([*tags[:-1], tags[0]], prompts_per_step=2, num_generations=G)
    with pytest.raises(WindowError, match="steps"):
        assemble_window([*tags[:-1], SlotTag(1, 1, 3, 1)], prompts_per_step=2, num_generations=G)
    with pytest.raises(WindowError, match="names rows"):
        assemble_window([*tags[:-1], SlotTag(0, 1, 3, 9)], prompts_per_step=2, num_generations=G)


# -- micro-batch tensors -------------------------------------------------------------------------------------
def test_collate_aligns_targets_with_completion_tokens() -> None:
    rows = [
        CompletionRow([1, 2, 3], [10, 11], [-0.5, -0.25], 1.0),
        CompletionRow([4, 5], [20, 21, 22, 23], None, -2.0),
    ]
    batch = collate_rows(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 10, 11, 0], [4, 5, 20, 21, 22, 23]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert batch["logits_to_keep"] == 5  # T − min prompt + 1
    targets, mask = batch["targets"], batch["completion_mask"].bool()
    assert targets[0][mask[0]].tolist() == [10, 11]
    assert targets[1][mask[1]].tolist() == [20, 21, 22, 23]
    assert batch["server_logprobs"][0][mask[0]].tolist() == [-0.5, -0.25]
    assert batch["server_logprobs_mask"][1].sum() == 0
    assert batch["advantages"].tolist() == [1.0, -2.0]
    with pytest.raises(ValueError, match="server log-probs"):
        collate_rows([CompletionRow([1], [2, 3], [-1.0], 0.0)], pad_id=0)


# -- image prompts -------------------------------------------------------------------------------------------
def make_image_row(index: int) -> PromptRow:
    """An image prompt: 2 text ids, 4 expanded placeholders (13), 2 text ids;
    M-RoPE positions with an image block."""
    rope = ((0, 1, 2, 2, 2, 2, 4, 5), (0, 1, 2, 2, 3, 3, 4, 5), (0, 1, 2, 3, 2, 3, 4, 5))
    return PromptRow(
        index=index,
        row_id=f"img{index}",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "image": f"/d/{index}.png"}, {"type": "text", "text": "x"}],
            }
        ],
        prompt_ids=[1, 2, 13, 13, 13, 13, 3, 4],
        reward_row={"task_mode": "summary", "domain": "BBU", "summary_ref": "无关图片"},
        rope_positions=rope,
        n_images=1,
    )


def test_image_prompts_are_sent_as_messages_text_prompts_as_ids() -> None:
    rows = [make_row(0), make_image_row(1)]
    batch = build_infer_batch(rows, global_step=0, first_index=0, seed=0, config=request_config(GrpoConfig()))
    text, image = batch.infer_requests
    assert text.prompt_token_ids == rows[0].prompt_ids and text.messages is None
    assert image.messages == rows[1].messages and image.prompt_token_ids is None
    assert image.all_image_refs() == ["/d/1.png"]
    # the server returns the expanded ids it conditioned on:
    # equal → grouped; different → the step fails naming both
    results = FakeSource(lambda r, j: "x").infer(batch)
    results = [results[0], results[1].model_copy(update={"prompt_token_ids": rows[1].prompt_ids})]
    assert [g.row for g in group_results(batch, results, rows, global_step=0)] == rows
    results[1] = results[1].model_copy(update={"prompt_token_ids": [1, 2, 13, 13, 3, 4]})
    with pytest.raises(
        GenerationError, match=r"expanded the prompt to 6 ids, the learner's processor to 8 .*position 4"
    ):
        group_results(batch, results, rows, global_step=0)


def test_collate_vl_rows_m_rope_positions_and_vision_tensors_in_row_order() -> None:
    row = make_image_row(0)
    pixels = [torch.full((4, 3), float(k)) for k in range(2)]
    grid = torch.tensor([[1, 2, 2]])
    rows = [
        CompletionRow(
            row.prompt_ids,
            [7, 8, 9],
            None,
            0.0,
            row.rope_positions,
            {"pixel_values": pixels[0], "image_grid_thw": grid},
        ),
        CompletionRow(
            row.prompt_ids,
            [7],
            None,
            0.0,
            row.rope_positions,
            {"pixel_values": pixels[1], "image_grid_thw": grid},
        ),
    ]
    batch = collate_rows(rows, pad_id=0)
    pos = batch["position_ids"]
    assert pos.shape == (4, 2, 11)
    assert pos[0, 0].tolist() == list(range(11))  # text positions
    # M-RoPE: the prompt's rows, then the completion continues every row from max(prompt) + 1 = 6
    assert pos[1:, 0, :].tolist() == [[*axis, 6, 7, 8] for axis in row.rope_positions]
    assert pos[1:, 1, :].tolist() == [[*axis, 6, 0, 0] for axis in row.rope_positions]  # padding keeps 0
    assert batch["pixel_values"].tolist() == torch.cat(pixels).tolist()
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert "position_ids" not in collate_rows([CompletionRow([1], [2], None, 0.0)], pad_id=0)
