"""What every backbone shares: the ``Backbone`` interface, mixer building from the ``attn`` config, the block.

A backbone is built from a *spec* (the paper's architecture, ``configs/model/<name>.yaml``,
see :mod:`.registry`) merged with the ``model`` config's overrides, and from
the ``attn`` config, which gives the mixer of the stages that use local
attention. ``make_mixer`` turns (attn config, width, heads, paper presets) into
one mixer and turns a failure into a ``UserError`` naming the model, the stage
and the variant.

Paper presets are options of the model's own mixer that the paper fixes: Focal's
``window_size``, ``expand_size``, ``focal_level``, per-stage ``focal_window`` and
``border`` are keys of its spec (``configs/model/focal_t.yaml`` / ``focal_s.yaml``,
overridable as ``model.<key>=``); DilateFormer's ``kernel_size=3, dilations=[1, 2, 3]``
(not architecture options) are ``PRESETS`` in :mod:`.dilateformer`. They apply only when
``attn`` is the model's native variant, and only to options that still hold
their ``configs/attn/<variant>.yaml`` value: an option set on the command line
(``attn.dilations=[1,2]``) wins. ``attn.heads`` is always replaced by the
model's per-stage heads (``model.heads`` overrides those).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from omegaconf import OmegaConf
from timm.layers import DropPath, Mlp, trunc_normal_
from torch import nn

import attention
from attention.errors import UserError

ATTN_CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "attn"
TASK_KEYS = frozenset({"name", "pretrained", "weights"})  # model config keys that belong to the task, not the net


@functools.lru_cache(maxsize=None)
def attn_defaults(variant: str) -> dict:
    """The options of ``configs/attn/<variant>.yaml`` (the class's defaults where there is no such file)."""
    path = ATTN_CONFIGS / f"{variant}.yaml"
    if path.is_file():
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        cfg.pop("name", None)
        return cfg
    return dict(attention.options(variant))


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def attn_options(attn: Mapping, presets: Mapping | None = None) -> dict:
    """``attn`` minus its name, with ``presets`` applied where the option still holds its yaml default."""
    name = attn["name"]
    opts = {k: v for k, v in attn.items() if k != "name"}
    defaults = attn_defaults(name)
    for key, value in (presets or {}).items():
        if key not in opts or (key in defaults and _same(opts[key], defaults[key])):
            opts[key] = value
    return opts


def make_mixer(attn: Mapping, dim: int, heads: int, *, model: str, stage: str, presets: Mapping | None = None,
               layout: str = "grid", force: Mapping | None = None):
    """One mixer of variant ``attn['name']`` for a stage of ``dim`` channels and ``heads`` heads.

    ``presets`` apply where the option holds its yaml default; ``force`` always (a structural rule of
    the model, e.g. Focal's window shrunk to a map smaller than it).
    """
    name = attn["name"]
    cls = attention.get(name)  # unknown variant: UserError listing the known ones
    if layout not in cls.layouts:
        raise UserError(f"model={model}, {stage}: attention variant {name!r} cannot serve it: the stage's tokens "
                        f"are laid out as {layout!r} and {name!r} serves {sorted(cls.layouts)}. Pick another attn.")
    opts = {**attn_options(attn, presets), **(force or {}), "heads": heads}
    try:
        return attention.build(name, dim=dim, **opts)
    except UserError as err:
        raise UserError(f"model={model}, {stage} (width {dim}, {heads} heads): attention variant {name!r} cannot "
                        f"serve this stage: {err} The heads come from the model (model.heads); change the variant's "
                        f"options (attn.<option>=...) or pick another attn.") from None


def merge_spec(name: str, spec: Mapping, model: Mapping) -> dict:
    """The paper's spec with the ``model`` config's overrides; unknown keys raise ``UserError``."""
    unknown = sorted(set(model) - set(spec) - TASK_KEYS)
    if unknown:
        raise UserError(f"model={name} has no option {', '.join(f'model.{k}' for k in unknown)}. Its options are: "
                        f"{', '.join(f'{k}={v!r}' for k, v in spec.items())}.")
    merged = dict(spec)
    merged.update({k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in model.items()
                   if k not in TASK_KEYS})
    return merged


def per_stage(name: str, key: str, value, stages: int) -> list:
    """A per-stage option as a list of ``stages`` values (a scalar is repeated)."""
    if not isinstance(value, (list, tuple)):
        return [value] * stages
    if len(value) != stages:
        raise UserError(f"model.{key}={list(value)} has {len(value)} entries but model={name} has {stages} stages "
                        f"(model.depths): give one value per stage.")
    return list(value)


def drop_path_rates(rate: float, depths: Sequence[int]) -> list[list[float]]:
    """Stochastic depth rising linearly from 0 to ``rate`` over all blocks, split per stage (timm/Swin)."""
    total = sum(depths)
    rates = [rate * i / max(total - 1, 1) for i in range(total)]  # torch.linspace, also under a meta device
    out, start = [], 0
    for d in depths:
        out.append(rates[start:start + d])
        start += d
    return out


def init_linears(module: nn.Module, skip=lambda m: False) -> None:
    """The papers' (timm's ViT/Swin) initialisation of every ``nn.Linear`` in ``module`` but those ``skip`` names:
    weights from a normal truncated at +-2 with std 0.02, biases zero. Modules are visited in ``modules()`` order;
    a Linear has no children, so that is also the order ``apply`` reaches them in, and seeded weights do not change
    with the way a backbone walks its tree."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and not skip(m):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + DropPath(mixer(LN(x)))``, ``x + DropPath(MLP(LN(x)))`` on (B, N, C)."""

    def __init__(self, dim: int, mixer: nn.Module, mlp_ratio: float = 4.0, drop_path: float = 0.0,
                 norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = mixer
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), layout))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class Backbone(nn.Module):
    """An image classifier that also gives multi-scale feature maps.

    Subclasses set ``feature_channels``, ``feature_strides``, ``num_features``,
    ``size_divisor`` (the input sides must be multiples of it unless ``pad``),
    ``pad`` and ``model_name``, and implement ``_forward(x) -> (features,
    pooled)`` on an input whose sides are multiples of ``size_divisor``:
    the per-stage maps and the (B, num_features) vector the classifier reads
    (ViT: the class token). ``head`` is a Linear to ``num_classes``, or
    ``nn.Identity`` when ``num_classes == 0`` (``forward`` then returns the
    pooled features, as timm does).
    """

    model_name: str = "?"
    native_attn: str = "?"  # the paper's mixer of the local stages (an attention variant), set by each backbone
    size_divisor: int = 1
    min_size: int = 1
    pad: bool = False
    feature_channels: list[int]
    feature_strides: list[int]
    num_features: int

    def no_weight_decay(self) -> set[str]:
        """Parameters timm's optimizer factory leaves undecayed besides norms and biases (which it finds
        itself): learned position embeddings, class tokens and relative position bias tables, as the papers'
        code does (DeiT, Swin/Focal). Convolutional position encodings (CPE) keep their decay."""
        return {name for name, _ in self.named_parameters()
                if name.split(".")[-1] in ("pos_embed", "cls_token") or "relative_position_bias_table" in name}

    def _resolve_class_token(self, class_token, attn: Mapping, tokens: str) -> bool:
        """``model.class_token`` as a bool: ``auto`` is a class token unless the variant needs the token grid
        (a grid-only local mixer), where a class token has no place; ``true`` with such a variant is refused."""
        grid_only = "none" not in attention.get(attn["name"]).layouts
        if class_token == "auto":
            return not grid_only
        if class_token and grid_only:
            raise UserError(f"model.class_token=true cannot be used with attn={attn['name']}: the variant needs the "
                            f"{tokens} grid and a class token has no place on it. Set model.class_token=auto or false.")
        return bool(class_token)

    def _add_head(self, widths: Sequence[int], strides: Sequence[int], num_classes: int, eps: float = 1e-5) -> None:
        """The final norm and the classifier (``nn.Identity`` when ``num_classes == 0``), and the feature maps'
        channels and strides (one per stage); created in this order, as the papers' code does, so that seeded
        initialisations stay the same."""
        self.norm = nn.LayerNorm(widths[-1], eps=eps)
        self.head = nn.Linear(widths[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.feature_channels, self.feature_strides, self.num_features = list(widths), list(strides), widths[-1]

    def check_input(self, h: int, w: int) -> None:
        """Raise ``UserError`` if an h x w image cannot be taken (naming ``data.img_size`` and valid sizes)."""
        d = self.size_divisor
        if h < self.min_size or w < self.min_size:
            raise UserError(f"Input size {h}x{w} (data.img_size) is too small for model={self.model_name}: "
                            f"expected at least {self.min_size}x{self.min_size}.")
        if self.pad or (h % d == 0 and w % d == 0):
            return
        near = sorted({max(d, (s // d) * d) for s in (h, w)} | {math.ceil(s / d) * d for s in (h, w)})
        raise UserError(f"Input size {h}x{w} (data.img_size) cannot be taken by model={self.model_name}: its "
                        f"patch embedding and merging need sides that are multiples of {d} (nearest valid sides: "
                        f"{', '.join(map(str, near))}). Set data.img_size to one of them, or model.pad=true to pad "
                        f"the input with zeros at the bottom and right.")

    def _checked(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        h, w = x.shape[-2:]
        self.check_input(h, w)
        d = self.size_divisor
        if h % d or w % d:
            x = F.pad(x, (0, -w % d, 0, -h % d))  # (B, 3, H', W'), sides multiples of d
        return self._forward(x)

    def forward_features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Feature maps (B, C_i, H_i, W_i), one per stage, at strides ``feature_strides`` (of the padded input)."""
        return self._checked(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._checked(x)[1])  # (B, num_classes), or (B, num_features) without a head

    def _forward(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def _stages_forward(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Hierarchical models (``stem``, ``stages``, ``downsamples``, ``norm``): every stage's map, and the normed
        mean of the last one."""
        x = self.stem(x)  # (B, C, H/4, W/4)
        features = []
        for stage, down in zip(self.stages, self.downsamples):
            x = stage(x)  # (B, C_i, H_i, W_i)
            features.append(x)
            x = down(x)
        pooled = self.norm(rearrange(x, "b c h w -> b (h w) c")).mean(dim=1)  # (B, C_last)
        return features, pooled

    def _tokens_forward(self, x: torch.Tensor, h: int, w: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Isotropic models (``blocks``, ``norm``, optional ``cls_token``): ``x`` (B, prefix + h*w, C) through the
        blocks; the token map at stride 16, and the class token or the mean token."""
        layout = None if self.cls_token is not None else attention.Grid(h, w)
        for block in self.blocks:
            x = block(x, layout)
        x = self.norm(x)
        tokens = x[:, self.num_prefix:]  # (B, N, C)
        pooled = x[:, 0] if self.cls_token is not None else tokens.mean(dim=1)  # (B, C)
        return [rearrange(tokens, "b (h w) c -> b c h w", h=h)], pooled
