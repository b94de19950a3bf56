"""Checks of a sync manifest against the engine before any byte is staged
(docs/ARCHITECTURE.md#sync-weights)."""

from __future__ import annotations

from collections.abc import Mapping

from rollout_server.engines.base import ParamSpec
from rollout_server.errors import LoraDisabledError, StaleVersionError, SyncValidationError
from shared_schemas.sync import SyncManifest

__all__ = ["check_manifest"]


def check_manifest(
    manifest: SyncManifest, *, current_version: int, lora_enabled: bool, specs: Mapping[str, ParamSpec]
) -> None:
    """Rejects a manifest the engine cannot apply.

    Full syncs may carry a subset of the parameters (e.g. only the language model), but every tensor must
    name an engine parameter with the same dtype and shape.

    Args:
        manifest: the begin request's manifest.
        current_version: the engine's weight version; the target must be greater.
        lora_enabled: whether the engine serves adapters.
        specs: the engine's parameter table (name → (dtype code, shape)).

    Raises:
        StaleVersionError: version <= current (409 `stale_version`).
        LoraDisabledError: adapter mode on a LoRA-less engine (409 `lora_disabled`).
        SyncValidationError: unknown name, dtype or shape mismatch (400 `sync_invalid`).
    """
    if manifest.version <= current_version:
        raise StaleVersionError(
            f"sync version {manifest.version} <= current weight_version {current_version};"
            f" send a version > {current_version}",
            detail={"version": manifest.version, "current_version": current_version},
        )
    if manifest.mode == "adapter":
        if not lora_enabled:
            raise LoraDisabledError(
                "adapter sync refused: the server runs without LoRA; sync full weights"
                " (rollout.sync.fallback_to_full) or start the server with server.vllm.enable_lora: true"
            )
        return
    for tensor in manifest.tensors:
        spec = specs.get(tensor.name)
        if spec is None:
            raise SyncValidationError(
                f"tensor {tensor.name!r} is not a parameter of the served model; send base-model parameter"
                " names (adapter wrappers stripped, .base_layer dropped)",
                type="unknown_parameter",
                detail={"name": tensor.name},
            )
        dtype, shape = spec
        if (tensor.dtype, tuple(tensor.shape)) != (dtype, tuple(shape)):
            raise SyncValidationError(
                f"tensor {tensor.name!r} is {tensor.dtype} {list(tensor.shape)} but the served parameter is"
                f" {dtype} {list(shape)}; cast/reshape it before sending",
                type="parameter_mismatch",
                detail={"name": tensor.name, "expected_dtype": dtype, "expected_shape": list(shape)},
            )
