"""Model name -> backbone class, filled by ``@register`` in the backbone modules, as ``attention/registry.py``
does for mixers; each name's architecture is its ``configs/model/<name>.yaml``.

The yaml is the architecture's one home (the constructors take every option and default none): it is what
``task=classification model=<name>`` composes, what ``model.<key>=`` overrides and what a run's resolved config
records, and :func:`spec` reads the same file for a backbone built by name alone (``task=segmentation
model.backbone=<name>``, library use). A new backbone is one module here and one yaml there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

from omegaconf import OmegaConf

from attention.errors import UserError
from attention.registry import Registry

from .common import merge_spec

MODEL_CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "model"
BACKBONES = Registry("model", "option `model`, or model.backbone in task=segmentation", "model=focal_t")


def register(*model_names: str):
    """Class decorator: make a backbone buildable by each of ``model_names`` (one class may serve several sizes,
    each with its yaml). Duplicate names are a bug, so they raise."""

    def deco(cls):
        for name in model_names:
            BACKBONES.add(name, cls)
        return cls

    return deco


def names() -> list[str]:
    """Registered model names, sorted."""
    return BACKBONES.names()


def get(name: str) -> type:
    return BACKBONES.get(name)


@functools.lru_cache(maxsize=None)
def _spec(name: str) -> tuple:
    path = MODEL_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"backbone {name!r} is registered but has no architecture file {path}: add it (its keys are "
                        f"the constructor's options, see configs/model/focal_t.yaml).")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return tuple((k, v) for k, v in cfg.items() if k not in ("name", "defaults"))


def spec(name: str) -> dict:
    """The paper's architecture of model ``name``: its configs/model yaml without ``name`` and ``defaults``."""
    get(name)
    return {k: (list(v) if isinstance(v, list) else v) for k, v in _spec(name)}


def build(model: Mapping, attn: Mapping, *, num_classes: int, img_size: int, in_chans: int = 3):
    """The backbone ``model['name']``: its spec with ``model``'s overrides, ``attn`` in its local stages."""
    name = model.get("name")
    cls = get(name)
    return cls(name, dict(attn), num_classes, img_size, in_chans, **merge_spec(name, spec(name), model))
