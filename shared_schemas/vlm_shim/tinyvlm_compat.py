"""Torchvision-free import shim for Qwen3-VL in transformers 5.x and vLLM (test environments only).

Without torchvision (the registry's builds are CUDA builds that break CPU torch), three imports fail:

1. `transformers.models.qwen2_vl.image_processing_qwen2_vl` hard-imports `torchvision.transforms.v2`;
   vLLM's `qwen2_vl.py` / `qwen3_vl.py` import `smart_resize` from it. The shim serves that module name
   from `image_processing_pil_qwen2_vl` (same `smart_resize`; `Qwen2VLImageProcessor` aliased to the PIL
   class).
2. `Qwen3VLVideoProcessor` on `transformers.models.qwen3_vl` (and the top level) is a torchvision-gated
   placeholder, although the real class in `video_processing_qwen3_vl` instantiates fine (only video
   preprocessing needs torchvision). The shim puts the real class on the (lazy) package module.
3. `ProcessorMixin` resolves the base class `VideoProcessorMixin` on the `transformers` top level (absent,
   then a torchvision-gated dummy mapping) and loads `video_processor` through the dummy
   `AutoVideoProcessor`. The shim resolves the mixin from `transformers.video_processing_utils` and loads
   the video processor with the real class named in the saved config.

The hook is a `sys.meta_path` finder: nothing is imported until transformers imports the patched modules
(modules already imported when `install()` runs are patched at once). `install()` does nothing when
torchvision imports (real GPU installs never need the shim).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["install", "install_everywhere", "installed", "torchvision_available"]

_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_QWEN3_VL_PACKAGE = "transformers.models.qwen3_vl"
_QWEN3_VL_VIDEO_MODULE = "transformers.models.qwen3_vl.video_processing_qwen3_vl"
_PROCESSING_UTILS = "transformers.processing_utils"
_VIDEO_CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json", "processor_config.json")

_installed = False


def torchvision_available() -> bool:
    """True when torchvision imports (then the shim must stay off)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # a CUDA build against CPU torch raises all sorts of errors at import
        return False
    return True


def installed() -> bool:
    """Whether `install()` put the hook on `sys.meta_path` in this process."""
    return _installed


class _AliasLoader(importlib.abc.Loader):
    """Serves `_IMAGE_MODULE` from the PIL module, without torchvision."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        pil = importlib.import_module(_PIL_IMAGE_MODULE)
        for key, value in vars(pil).items():
            if not key.startswith("__"):
                setattr(module, key, value)
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module that ended up in `sys.modules` (maybe a _LazyModule)."""

    def __init__(self, real: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._real = real
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._real.exec_module(module)
        # transformers model packages replace themselves in sys.modules with a _LazyModule.
        self._patch(sys.modules.get(module.__name__, module))

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code, …
        return getattr(self._real, name)


def _real_video_class() -> type:
    return importlib.import_module(_QWEN3_VL_VIDEO_MODULE).Qwen3VLVideoProcessor


def _patch_qwen3_vl_package(module: ModuleType) -> None:
    module.Qwen3VLVideoProcessor = _real_video_class()
    top = sys.modules.get("transformers")
    if top is not None:
        top.Qwen3VLVideoProcessor = module.Qwen3VLVideoProcessor


class _VideoProcessorLoader:
    """Stands in for the torchvision-gated `AutoVideoProcessor` when a processor loads its video part."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        return _real_video_class().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def _patch_processing_utils(module: ModuleType) -> None:
    if getattr(module, "_tinyvlm_compat_patched", False):
        return
    module._tinyvlm_compat_patched = True
    mixin = module.ProcessorMixin
    original = mixin.__dict__["get_possibly_dynamic_module"].__func__

    def get_possibly_dynamic_module(module_name: str) -> Any:
        if module_name == "VideoProcessorMixin":
            # Imported here: at patch time transformers is still initialising (circular import).
            return importlib.import_module("transformers.video_processing_utils").VideoProcessorMixin
        if module_name == "Qwen3VLVideoProcessor":
            return _real_video_class()
        return original(module_name)

    mixin.get_possibly_dynamic_module = staticmethod(get_possibly_dynamic_module)

    mapping = module.MODALITY_TO_AUTOPROCESSOR_MAPPING
    mapping_cls = type(mapping)
    original_getitem = mapping_cls.__getitem__

    class _ShimmedMapping(mapping_cls):  # type: ignore[misc, valid-type]
        def __getitem__(self, key: str) -> Any:
            if key == "video_processor":
                return _VideoProcessorLoader
            return original_getitem(self, key)

    module.MODALITY_TO_AUTOPROCESSOR_MAPPING = _ShimmedMapping()


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    _QWEN3_VL_PACKAGE: _patch_qwen3_vl_package,
    _PROCESSING_UTILS: _patch_processing_utils,
}


class _ShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _IMAGE_MODULE:
            real = importlib.machinery.PathFinder.find_spec(fullname, path)
            origin = real.origin if real is not None else None
            return importlib.util.spec_from_loader(fullname, _AliasLoader(), origin=origin)
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> bool:
    """Puts the hook first on `sys.meta_path` unless torchvision works; idempotent.

    Returns:
        True when the hook is active in this process.
    """
    global _installed
    if _installed:
        return True
    if torchvision_available():
        return False
    sys.meta_path.insert(0, _ShimFinder())
    # Modules imported before the hook (e.g. by an earlier import in a test session) are patched now.
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    _installed = True
    return True


def install_everywhere() -> bool:
    """`install()` in this process and, through `PYTHONPATH` (this folder's `sitecustomize.py`), in every
    Python process started from it afterwards (vLLM's engine core and its architecture-inspection subprocess).

    Returns:
        Whether the shim is active (False where torchvision imports).
    """
    import os
    from pathlib import Path

    if not install():
        return False
    here = str(Path(__file__).resolve().parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])
    return True
