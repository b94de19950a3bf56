"""Shared inputs of the summary-reward tests: the worked example of docs/ALGORITHM.md#reward-example."""

from __future__ import annotations

import json
from typing import Any

from learner.rewards.summary_parse import SummarySample, make_row, make_sample

WORKED_REF: dict[str, Any] = {
    "统计": [
        {"类别": "A", "可见性": {"完整": 2}, "捆扎": {"整齐": 1, "松散": 1}, "品牌": {"x": 2}},
        {"类别": "B", "位置": {"左侧": 1}, "文本": ["NR-01"]},
    ],
    "备注": ["n1"],
}
WORKED_PRED_LINE = (
    '{"统计": [{"类别": "A", "可见性": {"完整": 2}, "捆扎": {"整齐": 2}}, '
    '{"类别": "C", "位置": {"左侧": 1}}]}'
)
BBU_HEADER = "<DOMAIN=BBU>, <TASK=SUMMARY>"
RRU_HEADER = "<DOMAIN=RRU>, <TASK=SUMMARY>"


def row(ref: Any, domain: str = "BBU", task_mode: str = "summary") -> dict[str, Any]:
    return {"task_mode": task_mode, "domain": domain, "summary_ref": ref}


def answer(obj: dict[str, Any] | str, header: str = BBU_HEADER) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"{header}\n{body}"


def sample(
    completion: str, ref: Any = WORKED_REF, domain: str = "BBU", task_mode: str = "summary"
) -> SummarySample:
    return make_sample(completion, make_row(row(ref, domain, task_mode)))


WORKED_COMPLETION = f"{BBU_HEADER}\n{WORKED_PRED_LINE}<|im_end|>"
