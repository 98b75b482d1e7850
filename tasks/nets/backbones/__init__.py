"""ImageNet backbones of the seed papers, built from the shared ``attention`` package.

    from tasks.nets.backbones import MODELS, build_backbone
    net = build_backbone({"name": "focal_t"}, {"name": "focal", **options}, num_classes=1000, img_size=224)
    logits = net(images)                      # (B, 1000)
    maps = net.forward_features(images)       # [(B, C_i, H_i, W_i)], strides net.feature_strides

``model`` is the composed ``model`` config: ``name`` (one of :data:`MODELS`) and
optional overrides of the architecture, whose defaults (the papers' configs)
live in Python, one spec per name (``SPECS`` in each module), so any task can
build a backbone from its name alone; ``pretrained`` and ``weights`` are the
task's keys and are ignored here. ``attn`` is the ``attn`` config: ``name``
plus options; it replaces the mixer of the stages that use local attention
(DilateFormer stages 1-2, every Focal stage, every ViT / EAMLP block), with
the heads of the model's spec. DilateFormer's global stages keep ``self``
unless ``model.global_attn`` names another variant. Paper presets of the
native variant (DilateFormer: ``dilations=[1, 2, 3]``; Focal: per-stage
``focal_window``) are set in Python and apply only to options left at their
``configs/attn`` value (see :mod:`.common`).

| model | paper | params | GFLOPs (MACs) at 224 | top-1 |
| --- | --- | --- | --- | --- |
| dilateformer_t/s/b | Jiao et al. 2023 | 17.2M / 24.2M / 47.2M | 3.2 / 4.8 / 10.0 | 82.1 / 83.3 / 84.4 |
| focal_t / focal_s | Yang et al. 2021 | 28.9M / 51.1M | 4.9 / 9.1 | 82.2 / 83.5 |
| eamlp | Guo et al. 2022 | see :mod:`.eamlp` | | |
| vit_s | DeiT-S, Touvron et al. 2021 | 22M | 4.6 | 79.8 |
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from attention.errors import UserError

from .common import Backbone, attn_defaults

_MODULES = {  # name -> module holding its SPECS and build()
    "dilateformer_t": "dilateformer", "dilateformer_s": "dilateformer", "dilateformer_b": "dilateformer",
    "focal_t": "focal", "focal_s": "focal", "eamlp": "eamlp", "vit_s": "vit",
}
MODELS: tuple[str, ...] = tuple(_MODULES)
NATIVE_ATTN = {  # the paper's mixer of each model's local stages
    "dilateformer_t": "dilated", "dilateformer_s": "dilated", "dilateformer_b": "dilated",
    "focal_t": "focal", "focal_s": "focal", "eamlp": "external", "vit_s": "self",
}


def native_attn(name: str) -> dict:
    """The ``attn`` config of model ``name``'s own mixer: its configs/attn yaml (paper presets apply on build)."""
    variant = NATIVE_ATTN[name]
    return {"name": variant, **attn_defaults(variant)}


def build_backbone(model: Mapping, attn: Mapping, *, num_classes: int, img_size: int, in_chans: int = 3) -> Backbone:
    """The backbone ``model['name']`` with ``model``'s overrides and the ``attn`` variant in its local stages."""
    model = dict(model)
    name = model.get("name")
    if name not in MODELS:
        raise UserError(f"Unknown model {name!r} (option `model`, or model.backbone in task=segmentation). "
                        f"Available: {', '.join(MODELS)}. Pick one with e.g. `model=focal_t`.")
    module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return module.build(name, model, dict(attn), num_classes=num_classes, img_size=img_size, in_chans=in_chans)


__all__ = ["MODELS", "NATIVE_ATTN", "Backbone", "build_backbone", "native_attn"]
