"""A GRPO step's generation window from the ranks' completion slots (see ``learner.grpo.data``).

Each rank receives some of the step's slots from the dataloader; after an all-gather of their tags every
rank calls :func:`assemble_window`, which checks that the slots cover the step exactly — every
``(prompt_slot, generation)`` pair once, one step, one prompt row per prompt slot — and returns the prompt
row of every prompt slot in generation-batch order. The result never depends on which rank held which slot.
Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["SlotTag", "WindowError", "assemble_window", "slot_tags"]


class WindowError(RuntimeError):
    """The gathered slots do not form one complete generation window."""


@dataclass(frozen=True)
class SlotTag:
    """Where a completion slot sits in its step.

    Attributes:
        step: the dataset window (optimizer step of the first pass).
        prompt_slot: ``p``, position of the prompt in the generation batch.
        generation: ``j``, which of the ``G`` completions.
        row: prompt row index.
    """

    step: int
    prompt_slot: int
    generation: int
    row: int

    def flat_index(self, num_generations: int) -> int:
        """Position in the group-major generation batch: ``p · G + j``."""
        return self.prompt_slot * num_generations + self.generation


def slot_tags(raw: Iterable[Mapping[str, int]]) -> list[SlotTag]:
    """The tags of one micro-batch of slot dicts (from ``GenerationSlots``)."""
    return [SlotTag(int(s["step"]), int(s["prompt_slot"]), int(s["generation"]), int(s["row"])) for s in raw]


def assemble_window(tags: Sequence[SlotTag], *, prompts_per_step: int, num_generations: int) -> list[int]:
    """The prompt row of every prompt slot ``p = 0 .. prompts_per_step − 1``.

    Raises:
        WindowError: slots of several steps, a duplicated or missing ``(p, j)``, a prompt slot out of range,
            or one prompt slot naming two rows.
    """
    steps = sorted({t.step for t in tags})
    if len(steps) != 1:
        raise WindowError(
            f"one optimizer step received slots of steps {steps[:5]}; per_device_train_batch_size × world "
            "size × gradient_accumulation_steps must equal grpo.generation_batch_size"
        )
    expected = prompts_per_step * num_generations
    seen: dict[tuple[int, int], SlotTag] = {}
    rows: dict[int, int] = {}
    for tag in tags:
        key = (tag.prompt_slot, tag.generation)
        if not (0 <= tag.prompt_slot < prompts_per_step and 0 <= tag.generation < num_generations):
            raise WindowError(
                f"slot {key} is outside {prompts_per_step} prompts × {num_generations} generations"
            )
        if key in seen:
            raise WindowError(f"slot {key} of step {tag.step} was dealt twice")
        seen[key] = tag
        if rows.setdefault(tag.prompt_slot, tag.row) != tag.row:
            raise WindowError(
                f"prompt slot {tag.prompt_slot} names rows {rows[tag.prompt_slot]} and {tag.row}"
            )
    if len(seen) != expected:
        raise WindowError(
            f"step {steps[0]} gathered {len(seen)} of its {expected} completion slots; the dataset and the "
            "batch sizes disagree (generation_batch_size must equal the effective batch size)"
        )
    return [rows[p] for p in range(prompts_per_step)]
