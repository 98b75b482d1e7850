"""``external``: external attention (Guo et al., 2021, "Beyond self-attention").

Two learnable memory units M_k, M_v of S slots replace keys and values; the
attention map is normalised twice (softmax over tokens, then l1 over slots).
With heads > 1 this is EAMLP's multi-head form: the memories are shared by
the heads. Queries come from a linear projection; an output projection mixes
the heads, as in EAMLP. ``expand`` = e widens the queries as EAMLP does (its
``coef``): Linear(C, eC) queries in e x heads heads of C / heads channels,
output Linear(eC, C); e = 1 (the default) is EANet's form.

``in_proj=false out_proj=false`` leaves the queries and the output
projection out: the memories act on the tokens themselves, which is EANet's
``External_attention`` (model_torch.py) inside its conv1 -> memories -> conv2
+ BN block (``tasks/nets/segnet.py``; ``task=segmentation`` sets both for
``attn=external``). Its ``linear_0`` (S, C, 1) is ``mem_k`` and its
``linear_1`` (C, S, 1), transposed, ``mem_v``. ``attn_drop`` and ``proj_drop``
are dropout on the normalised map and after the output projection (EAMLP's
token blocks: 0.1 each).
"""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer, check_positive
from ..errors import UserError
from ..registry import register


@register("external")
class ExternalAttention(Mixer):
    complexity = "linear"  # a memory of S slots, not the tokens

    def __init__(self, dim: int, heads: int = 1, memory: int = 64, expand: int = 1, in_proj: bool = True,
                 out_proj: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__(dim, heads)
        check_positive("memory", memory, self.name)
        check_positive("expand", expand, self.name)
        for option, p in (("attn_drop", attn_drop), ("proj_drop", proj_drop)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise UserError(f"attn.{option}={p!r} is invalid for attention variant {self.name!r}: expected a "
                                "dropout probability in [0, 1) (EAMLP's token blocks use 0.1).")
        self.attn_drop, self.proj_drop = float(attn_drop), float(proj_drop)
        d = dim // heads
        self.memory, self.expand = memory, expand
        self.q = self.projection(dim, expand * dim, in_proj, "in_proj")
        self.mem_k = nn.Parameter(torch.randn(memory, d) * d ** -0.5)  # (S, d)
        # EANet initialises M_v as the transpose of M_k's initial weights; they train independently.
        self.mem_v = nn.Parameter(self.mem_k.detach().clone())  # (S, d)
        self.proj = self.projection(expand * dim, dim, out_proj, "out_proj")

    def mix(self, x, layout):
        q = rearrange(self.q(x), "b n (h d) -> b h n d", h=self.heads * self.expand)  # (B, e*heads, N, d)
        out = functional.external_attention(q, self.mem_k, self.mem_v, dropout=self.attn_drop,
                                            training=self.training)  # (B, e*heads, N, d)
        out = self.proj(rearrange(out, "b h n d -> b n (h d)"))
        return F.dropout(out, self.proj_drop, self.training) if self.proj_drop else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, memory={self.memory}" + (f", expand={self.expand}" if self.expand > 1 else "")
