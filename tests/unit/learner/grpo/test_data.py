"""GRPO prompt rows (learner/grpo/data.py), the synthetic summary set (learner/demo_data/summary.py) and the
step metrics (learner/grpo/metrics.py). Pure: a character-level fake encoder stands in for the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.data.errors import DataRecordError
from learner.demo_data.summary import IRRELEVANT_FRACTION, answer_text, generate_rows, write_rows
from learner.grpo.data import load_prompt_rows, prompt_order
from learner.grpo.metrics import MetricWindow, advantage_metrics, completion_metrics, reward_metrics
from learner.grpo.rollouts import Completion, Group
from learner.rewards.registry import PRESETS, total_reward


def encode(messages: list[dict[str, Any]]) -> list[int]:
    """One id per character of the concatenated contents (+1 for a generation prompt)."""
    return [ord(c) % 1000 for m in messages for c in str(m["content"])] + [1]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_rows_keep_reward_metadata_and_drop_assistant_turns(tmp_path: Path) -> None:
    file = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {
                "id": "x",
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer"}],
                "task_mode": "summary",
                "domain": "BBU",
                "summary_ref": "无关图片",
                "extra": 1,
            },
            {"prompt": "yo", "system": "sys", "task_mode": "dense"},
        ],
    )
    loaded = load_prompt_rows([file], encode, budget=100)
    first, second = loaded.rows
    assert first.messages == [{"role": "user", "content": "hi"}]
    assert first.reward_row == {"task_mode": "summary", "domain": "BBU", "summary_ref": "无关图片"}
    assert first.meta == {"extra": 1} and first.row_id == "x" and first.prompt_ids == encode(first.messages)
    assert second.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "yo"}]
    assert second.row_id == "a:2" and [r.index for r in loaded.rows] == [0, 1]


def test_overlong_prompts_are_deleted_and_counted(tmp_path: Path) -> None:
    rows = [{"prompt": "x" * n, "task_mode": "summary"} for n in (3, 10, 4, 20)]
    loaded = load_prompt_rows([write_jsonl(tmp_path / "a.jsonl", rows)], encode, budget=5)
    assert [len(r.prompt_ids) for r in loaded.rows] == [4, 5]
    assert loaded.deleted_overlong == 2 and [r.index for r in loaded.rows] == [0, 1]
    with pytest.raises(DataRecordError, match="no prompt left"):
        load_prompt_rows([write_jsonl(tmp_path / "b.jsonl", rows[1:2])], encode, budget=5)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x"}, "missing 'task_mode'"),
        ({"task_mode": "summary"}, "needs 'messages'"),
        (
            {"prompt": "x", "task_mode": "summary", "images": ["a.png"]},
            r"image\(s\) > data.max_images_per_sample 0",
        ),
        ({"prompt": "x", "task_mode": "summary", "images": "a.png"}, "'images' must be a list"),
        (
            {"messages": [{"role": "assistant", "content": "a"}], "task_mode": "summary"},
            "no system/user turn",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_rows_name_file_line_and_fix(tmp_path: Path, row: Any, message: str) -> None:
    file = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "task_mode": "summary"}, row])
    with pytest.raises(DataRecordError, match=message) as info:
        load_prompt_rows([file], encode, budget=100, max_images=0)
    assert f"{file}:2" in str(info.value)


class FakeEncoded:
    """What PromptEncoder.encode returns, for a fake image model: 3 placeholder ids per image."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        refs = [
            p["image"]
            for m in messages
            if isinstance(m["content"], list)
            for p in m["content"]
            if "image" in p
        ]
        self.ids = [*encode([{"content": json.dumps(messages)}]), *[13] * (3 * len(refs))]
        self.rope_positions = tuple(tuple(range(len(self.ids))) for _ in range(3))
        self.n_images = len(refs)


@pytest.mark.parametrize(
    ("row", "want"),
    [
        pytest.param(
            {"prompt": "count", "images": ["img/a.png"]},
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "ROOT/img/a.png"},
                        {"type": "text", "text": "count"},
                    ],
                }
            ],
            id="images-go-first-in-the-user-turn",
        ),
        pytest.param(
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image"}]},
                ],
                "images": ["/abs/b.png"],
            },
            [
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "t"}, {"type": "image", "image": "/abs/b.png"}],
                },
            ],
            id="ref-less-part-takes-the-next-image",
        ),
        pytest.param(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": "c.png"}, {"type": "text", "text": "x"}],
                    }
                ]
            },
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "ROOT/c.png"}, {"type": "text", "text": "x"}],
                }
            ],
            id="relative-part-ref-resolved",
        ),
    ],
)
def test_image_rows_resolve_refs_like_stage2(tmp_path: Path, row: dict[str, Any], want: list[Any]) -> None:
    root = tmp_path / "root"
    file = write_jsonl(tmp_path / "a.jsonl", [{**row, "task_mode": "summary"}])
    loaded = load_prompt_rows([file], FakeEncoded, budget=10_000, image_root=root, max_images=1)
    (prompt,) = loaded.rows
    assert prompt.messages == json.loads(json.dumps(want).replace("ROOT", str(root)))
    assert prompt.n_images == 1 and prompt.has_images and prompt.prompt_ids[-3:] == [13, 13, 13]
    assert prompt.rope_positions is not None and len(prompt.rope_positions[0]) == len(prompt.prompt_ids)
    # without data.image_root, relative refs resolve against the JSONL file's directory
    (again,) = load_prompt_rows([file], FakeEncoded, budget=10_000).rows
    assert (
        "ROOT" not in json.dumps(want)
        or str(tmp_path) in json.dumps(again.messages)
        and str(root) not in json.dumps(again.messages)
    )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "images": ["a.png", "b.png"]}, r"2 image\(s\) > data.max_images_per_sample 1"),
        (
            {
                "messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}],
                "images": ["b.png"],
            },
            "left over",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "no reference"),
        ({"prompt": "x", "images": ["/no/such.png"]}, "unreadable"),
    ],
)
def test_bad_image_rows_name_file_and_line(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    def encode_or_fail(messages: list[dict[str, Any]]) -> FakeEncoded:
        if "/no/such.png" in json.dumps(messages):
            raise OSError("image /no/such.png is unreadable")
        return FakeEncoded(messages)

    file = write_jsonl(tmp_path / "bad.jsonl", [{**row, "task_mode": "summary"}])
    with pytest.raises(DataRecordError, match=message) as info:
        load_prompt_rows([file], encode_or_fail, budget=10_000, max_images=1)
    assert f"{file}:1" in str(info.value)


def test_prompt_order_is_a_permutation_per_pass() -> None:
    order = prompt_order(5, 12, seed=3)
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:10]) == list(range(5))
    assert order == prompt_order(5, 12, seed=3) and order != prompt_order(5, 12, seed=4)


def test_synthetic_rows_are_deterministic_and_their_answers_score_full_format() -> None:
    rows = generate_rows(200, seed=1)
    assert rows == generate_rows(200, seed=1)
    assert rows != generate_rows(200, seed=1, split="eval")
    irrelevant = sum(r["summary_ref"] == "无关图片" for r in rows)
    assert abs(irrelevant / len(rows) - IRRELEVANT_FRACTION) < 0.08
    assert {r["domain"] for r in rows} == {"BBU", "RRU"}
    totals, per = total_reward([r["answer"] for r in rows], rows, PRESETS["server"])
    assert per["summary.format"] == [1.0] * len(rows)  # the reference answer is a perfect completion
    assert per["summary.parse"] == [0.0] * len(rows) and per["summary.strict"] == [0.0] * len(rows)
    relevant = [i for i, r in enumerate(rows) if r["summary_ref"] != "无关图片"]
    assert all(per["summary.content_structured_tversky"][i] == 1.0 for i in relevant)
    assert all(per["summary.category_recall"][i] == 1.0 for i in relevant)
    assert answer_text("RRU", None) == "无关图片"


def test_write_rows_is_idempotent(tmp_path: Path) -> None:
    rows = generate_rows(3)
    path = tmp_path / "d" / "train.jsonl"
    assert write_rows(path, rows) is True
    assert write_rows(path, rows) is False
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows


def _group(rewards: list[float], lengths: list[int], truncated: int = 0) -> Group:
    completions = [
        Completion(list(range(n)), "t", "length" if i < truncated else "stop") for i, n in enumerate(lengths)
    ]
    group = Group(prompt_index=0, row=None, completions=completions)  # type: ignore[arg-type]
    group.rewards = rewards
    group.per_reward = {"summary.format": [1.0 if r > 0 else 0.0 for r in rewards]}
    return group


def test_step_metrics() -> None:
    groups = [_group([1.0, 3.0], [2, 4], truncated=1), _group([0.0, 0.0], [6, 8])]
    rewards = reward_metrics(groups, first_round=[5.0, 5.0, 1.0, 1.0])
    assert rewards["reward/total_mean"] == 1.0
    assert rewards["reward/total_std"] == pytest.approx(torch.tensor([1.0, 3.0, 0.0, 0.0]).std().item())
    assert rewards["reward/summary.format/mean"] == 0.5 and rewards["reward/first_round_total_mean"] == 3.0
    assert completion_metrics(groups) == {
        "completions/mean_length": 5.0,
        "completions/max_length": 8.0,
        "completions/truncated_ratio": 0.25,
    }
    adv = advantage_metrics(torch.tensor([-2.0, 0.0, 2.0]))
    assert adv == {"advantages/mean": 0.0, "advantages/std": 2.0, "advantages/abs_max": 2.0}


def test_metric_window_averages_steps_and_reduces_sums() -> None:
    window = MetricWindow()
    window.add_step({"reward/total_mean": 1.0})
    window.add_step({"reward/total_mean": 3.0})
    window.add_sum("kl/mean", 0.5, 2)
    window.add_sum("kl/mean", 1.0, 2)
    window.add_max("time/x", 1.0)
    window.add_max("time/x", 4.0)
    keys, flat, max_keys, maxima = window.reduce_vector()
    assert (keys, flat, max_keys, maxima) == (["kl/mean"], [1.5, 4.0], ["time/x"], [4.0])
    # as if another rank had added (sum 2.5, count 4) and max 6:
    # the all-reduced vectors replace the local ones
    out = window.finalize([4.0, 8.0], [6.0])
    assert out == {"reward/total_mean": 2.0, "kl/mean": 0.5, "time/x": 6.0}
    assert window.finalize() == {}
