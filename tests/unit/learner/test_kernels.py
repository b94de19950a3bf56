"""`learner.kernels`: the varlen kernels' names are spelled once (`VARLEN_KERNEL_NAMES`, the order `auto`
tries them), every one is registered, and `model.varlen_kernel` accepts exactly them and `auto`; the registry
refuses other names and second registrations."""

from __future__ import annotations

from typing import get_args

import pytest

from learner.config import ModelConfig
from learner.kernels import VARLEN_CHOICES, VARLEN_KERNEL_NAMES, VARLEN_KERNELS, VarlenKernel
from learner.kernels.attention import SEGMENT_SDPA, VISION_VARLEN, attention_functions, attention_name
from learner.kernels.varlen import get_kernel, register


def test_config_literal_is_the_registry() -> None:
    accepted = get_args(ModelConfig.model_fields["varlen_kernel"].annotation)
    assert accepted == ("auto", *VARLEN_KERNEL_NAMES), (
        "learner/config.py's ModelConfig.varlen_kernel must list auto and then learner.kernels."
        f"VARLEN_KERNEL_NAMES in order: {accepted} vs {VARLEN_KERNEL_NAMES}"
    )
    assert list(VARLEN_KERNELS) == sorted(VARLEN_KERNELS, key=VARLEN_KERNEL_NAMES.index)
    assert set(VARLEN_KERNELS) == set(VARLEN_KERNEL_NAMES)
    for name, cls in VARLEN_KERNELS.items():
        assert cls.name == name and isinstance(get_kernel(name), cls)


def test_registry_refuses_unknown_and_taken_names() -> None:
    with pytest.raises(ValueError, match="varlen attention kernel 'fa3' is not one of"):
        register("fa3")
    with pytest.raises(ValueError, match="registered already"):
        register("torch")(type("Other", (VarlenKernel,), {}))
    with pytest.raises(ValueError, match="unknown varlen kernel 'fa3'; known: fa4, torch"):
        get_kernel("fa3")


def test_one_attention_function_per_choice_and_tower() -> None:
    """The kernel choice travels in the attention implementation's name; `auto` keeps the base names, and
    only the vision tower's names contain "flash" (transformers then passes its `cu_seqlens`)."""
    names = attention_functions()
    assert len(names) == 2 * len(VARLEN_CHOICES)
    assert attention_name(SEGMENT_SDPA, "auto") == SEGMENT_SDPA and attention_name(VISION_VARLEN, "") in names
    assert all(("flash" in name) == name.startswith(VISION_VARLEN) for name in names)
    assert {fn.keywords["varlen_choice"] for fn in names.values()} == set(VARLEN_CHOICES)
