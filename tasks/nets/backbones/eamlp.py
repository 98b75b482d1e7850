"""``eamlp``: EAMLP-14 (Guo et al., 2022, "Beyond Self-attention: External Attention using Two Linear
Layers for Visual Tasks", TPAMI), after the official ``EAMLP/models`` of MenghaoGuo/EANet: a T2T-ViT-14
(Yuan et al., 2021) whose attention is multi-head external attention.

Published: EAMLP-14 30M parameters, 78.9% ImageNet top-1 at 224 (EAMLP-19: 55M, 79.4%); the paper gives
no FLOPs for it.

    image (B, 3, H, W)
    tokens-to-token (the stem; its mixers are always external attention, as the official):
               unfold 7x7 stride 4 (147 ch) -> token block -> unfold 3x3 stride 2 (576 ch) -> token block
               -> unfold 3x3 stride 2 -> Linear 576 -> 384                                  -> (B, H/16 * W/16, 384)
               token block: r = Linear(LN(x)) to 64 ch; r + EA(r) (one head, 128 slots, no query projection,
               dropout 0.1 on the map and the projection); + MLP(LN) ratio 1
    class token + fixed 1-D sinusoid position table (the official ``get_sinusoid_encoding``)
    14 pre-norm blocks, width 384, MLP ratio 3, drop path 0.1:
               x + DropPath(mixer(LN(x))), x + DropPath(MLP(LN(x)))
    head       LN, Linear on the class token

The paper's mixer (``attn=external``, multi-head EA): queries Linear(C, 4C) (the official ``coef = 4``
widening, ``trans_dims``), 4 x 6 = 24 heads of 64 channels, memories M_k, M_v of 64 slots shared by the
heads, double normalisation (``attention.functional.external_attention``), output Linear(4C, C): the
shared ``external`` variant with ``expand=model.ea_expand``. The official memories are Linear layers with
biases: the key bias is a constant per slot and cancels in the softmax over tokens, the value bias folds into
the output bias, so they are left out (128 parameters per block; ``EAMLP.from_official`` folds them in).

``attn=X`` (any other variant) replaces the mixer of every block (heads ``model.heads``); a grid-only
variant drops the class token and pools the average token (as ``vit_s``). Inputs: sides multiples of 16
(``model.pad=true`` pads); ``forward_features`` gives the final-normed tokens as one map at stride 16.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers import Mlp, trunc_normal_
from torch import nn

import attention
from attention.errors import UserError
from attention.tensor_cache import tensor_cache
from attention.variants.external import ExternalAttention

from .common import Backbone, Block, attn_options, drop_path_rates, init_linears, make_mixer
from .registry import register

PRESETS = {"memory": 64}  # the official k = 256 // coef
PASSED = ("in_proj", "out_proj", "attn_drop", "proj_drop")  # attn options the blocks' external attention takes


class TokenBlock(nn.Module):
    """T2T re-structurisation with EA: r = Linear(LN(x)); r = r + EA(r); r + MLP(LN(r)) (ratio 1).

    The official ``token_performer.Attention``: its ``q_linear`` is ``reduce`` and feeds the memories directly
    (the mixer's own query projection is off), dropout ``drop`` on the map and after the projection (0.1).
    """

    def __init__(self, cin: int, dim: int, memory: int, drop: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(cin)
        self.reduce = nn.Linear(cin, dim)
        self.attn = attention.build("external", dim=dim, heads=1, memory=memory, in_proj=False, attn_drop=drop,
                                    proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.reduce(self.norm1(x))  # (B, N, dim)
        r = r + self.attn(r)
        return r + self.mlp(self.norm2(r))


class TokensToToken(nn.Module):
    """Soft splits 7/4, 3/2, 3/2 (stride 16) with two EA token blocks between them, then Linear to ``embed_dim``."""

    def __init__(self, in_chans: int, embed_dim: int, token_dim: int, memory: int, drop: float):
        super().__init__()
        self.block1 = TokenBlock(in_chans * 49, token_dim, memory, drop)
        self.block2 = TokenBlock(token_dim * 9, token_dim, memory, drop)
        self.project = nn.Linear(token_dim * 9, embed_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        h, w = x.shape[-2] // 4, x.shape[-1] // 4
        x = self.block1(F.unfold(x, 7, stride=4, padding=2).transpose(1, 2))  # (B, H/4 * W/4, token_dim)
        x = rearrange(x, "b (h w) c -> b c h w", h=h)
        x = self.block2(F.unfold(x, 3, stride=2, padding=1).transpose(1, 2))  # (B, H/8 * W/8, token_dim)
        x = rearrange(x, "b (h w) c -> b c h w", h=h // 2)
        x = self.project(F.unfold(x, 3, stride=2, padding=1).transpose(1, 2))  # (B, H/16 * W/16, embed_dim)
        return x, h // 4, w // 4


@tensor_cache(maxsize=16)
def sinusoid_table(n: int, dim: int) -> torch.Tensor:
    """(1, n, dim) fixed 1-D sinusoid position table: sin on even channels, cos on odd (Vaswani et al.)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]  # (n, 1)
    wavelength = torch.pow(10000.0, 2 * (torch.arange(dim, dtype=torch.float64) // 2) / dim)  # (dim,), in float64
    angle = pos / wavelength  # (n, dim), as the official table (float32 rounding here moved it by up to 7e-6)
    table = torch.where(torch.arange(dim) % 2 == 0, angle.sin(), angle.cos())
    return table.float()[None]


@register("eamlp")
class EAMLP(Backbone):
    """The architecture's options: configs/model/eamlp.yaml."""

    native_attn = "external"
    official_weights: ClassVar[str] = ("EAMLP's ImageNet checkpoints (MenghaoGuo/EANet, EAMLP/: T2T_ViT with "
                                       "tokens_type='performer', e.g. EAMLP-14's model_best.pth.tar)")
    # The official main.py evaluates load_checkpoint(..., use_ema=args.model_ema), model_ema on by default, and
    # keeps the checkpoint whose EMA scored best: of a file holding both, the EMA weights are the published model.
    official_ema_keys: ClassVar[tuple[str, ...]] = ("state_dict_ema",)

    def __init__(self, name: str, attn: Mapping, num_classes: int, img_size: int, in_chans: int = 3, *,
                 embed_dim: int, depth: int, heads: int, mlp_ratio: float, drop_path_rate: float, ea_expand: int,
                 token_dim: int, token_memory: int, token_drop: float, class_token, global_attn: str, pad: bool):
        super().__init__()
        self.model_name, self.pad = name, bool(pad)
        self.size_divisor = self.min_size = 16
        class_token = self._resolve_class_token(class_token, attn, "token")
        self.tokens_to_token = TokensToToken(in_chans, embed_dim, token_dim, token_memory, token_drop)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.num_prefix = int(bool(class_token))
        rates = drop_path_rates(drop_path_rate, [depth])[0]
        layout = "none" if class_token else "grid"
        blocks = []
        for i in range(depth):
            if attn["name"] == self.native_attn:
                opts = attn_options(attn, PRESETS)
                unknown = sorted(set(opts) - {"memory", "heads", "expand", *PASSED})
                if unknown:
                    raise UserError(f"model={name}: the external attention of its blocks has no option "
                                    f"{', '.join(f'attn.{k}' for k in unknown)}; its options are attn.memory, "
                                    f"{', '.join(f'attn.{k}' for k in PASSED)} and model.ea_expand.")
                mixer = attention.build(self.native_attn, dim=embed_dim, heads=heads, memory=opts["memory"],
                                        expand=ea_expand,  # PRESETS put memory in opts unless attn.memory was set
                                        **{k: opts[k] for k in PASSED if k in opts})
            else:
                mixer = make_mixer(attn, embed_dim, heads, model=name, stage=f"block {i + 1}", layout=layout)
            blocks.append(Block(embed_dim, mixer, mlp_ratio, rates[i]))
        self.blocks = nn.ModuleList(blocks)
        self._add_head([embed_dim], [16], num_classes)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)
        init_linears(self)
        self._init_memories()

    def _init_memories(self) -> None:
        """The memories as the official ``T2T_ViT._init_weights`` leaves them, not the variant's EANet init.

        Officially they are ``nn.Linear`` layers, so the model-wide ``apply`` draws them like every Linear: a
        normal truncated at +-2 with std 0.02. In the 14 main blocks ``linear_0`` and ``linear_1`` are drawn
        independently. In the token blocks ``linear_1.weight.data`` is set to a view of ``linear_0``'s transposed
        weight (``token_performer.py``): one storage, so the second draw overwrites the first and both memories
        start equal (M_v = M_k here, since ``mem_v`` is ``linear_1.weight`` transposed).
        """
        with torch.no_grad():
            for block in (self.tokens_to_token.block1, self.tokens_to_token.block2):
                trunc_normal_(block.attn.mem_v, std=0.02)
                block.attn.mem_k.copy_(block.attn.mem_v)
            for block in self.blocks:
                if isinstance(block.attn, ExternalAttention):  # attn=external: the paper's blocks
                    trunc_normal_(block.attn.mem_k, std=0.02)
                    trunc_normal_(block.attn.mem_v, std=0.02)

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The official ``T2T_ViT`` (tokens_type="performer") state dict in this network's keys.

        Renames: ``attention1/2`` -> ``block1/2``, ``q_linear`` -> ``reduce``, ``trans_dims`` -> ``q``; the
        memories ``linear_0.weight`` (S, d) is ``mem_k`` and ``linear_1.weight`` (d, S) transposed ``mem_v``. Their
        biases are not parameters here, exactly: ``linear_0``'s is constant over the tokens, so the softmax over
        tokens cancels it; ``linear_1``'s is added to every head's output before ``proj``, so it moves into
        ``proj.bias`` as ``proj.weight @ bias`` (repeated over the heads). ``pos_embed``, the fixed sinusoid
        table, is computed here and dropped when it is that table.
        """
        out = {}
        for key, value in state.items():
            key = key.replace("tokens_to_token.attention", "tokens_to_token.block").replace(".attn.q_linear.", ".reduce.")
            key = key.replace(".attn.trans_dims.", ".attn.q.")
            if key.endswith("attn.linear_0.weight"):
                out[key.replace("linear_0.weight", "mem_k")] = value
            elif key.endswith("attn.linear_1.weight"):
                out[key.replace("linear_1.weight", "mem_v")] = value.T
            elif key == "pos_embed" and torch.allclose(value.float(), sinusoid_table(*value.shape[1:]), atol=1e-6):
                continue
            elif not key.endswith(("attn.linear_0.bias", "attn.linear_1.bias")):
                out[key] = value
        for key, bias in state.items():  # fold linear_1's bias into proj's
            if key.endswith("attn.linear_1.bias"):
                prefix = key.replace("tokens_to_token.attention", "tokens_to_token.block")[:-len("linear_1.bias")]
                names = [key.replace("linear_1.bias", f"proj.{n}") for n in ("weight", "bias")]
                if not all(n in state for n in names):  # not EAMLP's block: kept, so the loader names the keys
                    out[prefix + "linear_1.bias"] = bias
                    continue
                weight, proj_bias = (state[n] for n in names)
                out[prefix + "proj.bias"] = proj_bias + weight @ bias.repeat(weight.shape[1] // len(bias))  # H*d
        return out

    def _forward(self, x):
        x, h, w = self.tokens_to_token(x)  # (B, N, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, C)
        x = x + sinusoid_table(x.shape[1], x.shape[2]).to(x)
        return self._tokens_forward(x, h, w)

