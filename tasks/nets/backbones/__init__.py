"""ImageNet backbones of the seed papers, built from the shared ``attention`` package.

    from tasks.nets.backbones import MODELS, build_backbone
    net = build_backbone({"name": "focal_t"}, {"name": "focal", **options}, num_classes=1000, img_size=224)
    logits = net(images)                      # (B, 1000)
    maps = net.forward_features(images)       # [(B, C_i, H_i, W_i)], strides net.feature_strides

Every module in this folder registers its backbone class under its model names
(``@register``, :mod:`.registry`) and is imported here, so a new backbone is one
module and one ``configs/model/<name>.yaml``. ``model`` is the composed ``model``
config: ``name`` (one of :data:`MODELS`) and optional overrides of the
architecture, whose defaults (the papers' configs) are that yaml, read for a
backbone built by name alone too (:func:`.registry.spec`); ``pretrained`` and
``weights`` are the task's keys and are ignored here. ``attn`` is the ``attn``
config: ``name`` plus options; it replaces the mixer of the stages that use
local attention (DilateFormer stages 1-2, every Focal stage, every ViT / EAMLP
block), with the heads of the model's spec. DilateFormer's global stages keep
``self`` unless ``model.global_attn`` names another variant. Each class declares
its paper's mixer (``native_attn``); paper presets of it (Focal: ``window_size``,
per-stage ``focal_window``, ... as keys of its ``configs/model`` yaml; DilateFormer:
``dilations=[1, 2, 3]``, in :mod:`.dilateformer`) apply only to options left at
their ``configs/attn`` value (see :mod:`.common`).

| model | paper | params | GFLOPs (MACs) at 224 | top-1 |
| --- | --- | --- | --- | --- |
| dilateformer_t/s/b | Jiao et al. 2023 | 17.2M / 24.2M / 47.2M | 3.2 / 4.8 / 10.0 | 82.1 / 83.3 / 84.4 |
| focal_t / focal_s | Yang et al. 2021 | 28.9M / 51.1M | 4.9 / 9.1 | 82.2 / 83.5 |
| eamlp | Guo et al. 2022 | see :mod:`.eamlp` | | |
| vit_s | DeiT-S, Touvron et al. 2021 | 22M | 4.6 | 79.8 |
"""

from __future__ import annotations

import importlib
import pkgutil

from .common import Backbone, attn_defaults
from .registry import build as build_backbone
from .registry import get, names, register, spec

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ("common", "registry"):
        importlib.import_module(f"{__name__}.{_mod.name}")

MODELS: tuple[str, ...] = tuple(names())
NATIVE_ATTN: dict[str, str] = {name: get(name).native_attn for name in MODELS}  # each model's paper mixer


def native_attn(name: str) -> dict:
    """The ``attn`` config of model ``name``'s own mixer: its configs/attn yaml (paper presets apply on build)."""
    variant = get(name).native_attn
    return {"name": variant, **attn_defaults(variant)}


__all__ = ["MODELS", "NATIVE_ATTN", "Backbone", "build_backbone", "get", "names", "native_attn", "register", "spec"]
