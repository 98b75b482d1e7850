"""EAMLP against the official T2T_ViT of MenghaoGuo/EANet@59c03cb (EAMLP/models: t2t_vit.py with
tokens_type="performer", token_performer.py, transformer_block.py), transliterated here in float64 with the
official attribute names, so that its state dict is a released checkpoint's layout."""

import numpy as np
import pytest
import torch
from torch import nn

import attention
from attention.errors import UserError
from tasks.nets.backbones import build_backbone
from tasks.nets.weights import load_weights


class Mlp(nn.Module):
    def __init__(self, cin, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(cin, hidden), nn.GELU(), nn.Linear(hidden, cin)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TokenAttention(nn.Module):  # token_performer.Attention
    def __init__(self, dim, in_dim, k=128, drop=0.1):
        super().__init__()
        self.q_linear = nn.Linear(dim, in_dim)
        self.linear_0 = nn.Linear(in_dim, k, bias=False)
        self.linear_1 = nn.Linear(k, in_dim)
        self.proj = nn.Linear(in_dim, in_dim)
        self.attn_drop, self.proj_drop = nn.Dropout(drop), nn.Dropout(drop)

    def forward(self, x):
        x = self.q_linear(x)
        idn = x
        attn = self.linear_0(x).softmax(dim=-2)
        attn = self.attn_drop(attn / (1e-9 + attn.sum(dim=-1, keepdim=True)))
        return idn + self.proj_drop(self.proj(self.linear_1(attn)))


class TokenPerformer(nn.Module):
    def __init__(self, dim, in_dim):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TokenAttention(dim, in_dim)
        self.norm2, self.mlp = nn.LayerNorm(in_dim), Mlp(in_dim, in_dim)

    def forward(self, x):
        x = self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Attention(nn.Module):  # transformer_block.Attention: multi-head EA, coef 4
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads * 4
        self.trans_dims = nn.Linear(dim, dim * 4)
        self.linear_0 = nn.Linear(dim * 4 // self.num_heads, 64)
        self.linear_1 = nn.Linear(64, dim * 4 // self.num_heads)
        self.proj = nn.Linear(dim * 4, dim)

    def forward(self, x):
        b, n, _ = x.shape
        x = self.trans_dims(x).view(b, n, self.num_heads, -1).permute(0, 2, 1, 3)
        attn = self.linear_0(x).softmax(dim=-2)
        attn = attn / (1e-9 + attn.sum(dim=-1, keepdim=True))
        return self.proj(self.linear_1(attn).permute(0, 2, 1, 3).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class T2TModule(nn.Module):
    def __init__(self, embed_dim, token_dim):
        super().__init__()
        self.soft_split0 = nn.Unfold(7, stride=4, padding=2)
        self.soft_split1 = nn.Unfold(3, stride=2, padding=1)
        self.soft_split2 = nn.Unfold(3, stride=2, padding=1)
        self.attention1 = TokenPerformer(3 * 49, token_dim)
        self.attention2 = TokenPerformer(token_dim * 9, token_dim)
        self.project = nn.Linear(token_dim * 9, embed_dim)

    def forward(self, x):
        x = self.attention1(self.soft_split0(x).transpose(1, 2))
        b, hw, c = x.shape
        x = x.transpose(1, 2).reshape(b, c, int(np.sqrt(hw)), int(np.sqrt(hw)))
        x = self.attention2(self.soft_split1(x).transpose(1, 2))
        b, hw, c = x.shape
        x = x.transpose(1, 2).reshape(b, c, int(np.sqrt(hw)), int(np.sqrt(hw)))
        return self.project(self.soft_split2(x).transpose(1, 2))


def sinusoid(n, d):
    table = np.array([[p / np.power(10000, 2 * (j // 2) / d) for j in range(d)] for p in range(n)])
    table[:, 0::2], table[:, 1::2] = np.sin(table[:, 0::2]), np.cos(table[:, 1::2])
    return torch.FloatTensor(table).unsqueeze(0)


class T2TViT(nn.Module):
    def __init__(self, img_size=224, embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0, token_dim=64, classes=1000):
        super().__init__()
        self.tokens_to_token = T2TModule(embed_dim, token_dim)
        n = (img_size // 16) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(sinusoid(n + 1, embed_dim), requires_grad=False)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(embed_dim), nn.Linear(embed_dim, classes)

    def forward(self, x):
        x = self.tokens_to_token(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 + (1.0 if "norm" in name and
                                                                                  name.endswith("weight") else 0.0))
    return module.eval()


SMALL = {"embed_dim": 48, "depth": 2, "heads": 2, "token_dim": 16}


def test_official_eamlp_file_loads_and_computes_the_official_function(tmp_path):
    official = randomise(T2TViT(32, 48, 2, 2, 3.0, 16, classes=10).double(), 0)
    torch.save({"state_dict": official.state_dict(), "epoch": 299}, tmp_path / "model_best.pth.tar")
    ours = build_backbone({"name": "eamlp", **SMALL}, {"name": "external"}, num_classes=10, img_size=32).double()
    assert load_weights(ours.eval(), str(tmp_path / "model_best.pth.tar")) == "official"
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), official(x), rtol=1e-9, atol=1e-9)


def test_token_blocks_drop_as_the_official_ones():
    ours = build_backbone({"name": "eamlp", **SMALL}, {"name": "external"}, num_classes=10, img_size=32)
    mixer = ours.tokens_to_token.block1.attn
    assert (mixer.attn_drop, mixer.proj_drop) == (0.1, 0.1) and isinstance(mixer.q, nn.Identity)
    x = torch.randn(2, 64, 16)
    torch.manual_seed(0)
    a = mixer.train()(x)
    assert not torch.equal(a, mixer(x)) and torch.equal(mixer.eval()(x), mixer(x))


def test_eamlp_14_parameters_and_released_key_layout():
    official = T2TViT()
    counted = sum(p.numel() for p in official.parameters() if p.requires_grad)
    ours = build_backbone({"name": "eamlp"}, {"name": "external"}, num_classes=1000, img_size=224)
    # The official EAMLP-14 has 29,801,422; here 1,920 fewer, the biases that cancel or fold exactly:
    # linear_0's (14 x 64) and linear_1's (14 x 64 + 2 x 64).
    assert counted == 29_801_422 and sum(p.numel() for p in ours.parameters()) == counted - 1_920
    state = official.state_dict()
    assert len(state) == 262
    ours.load_state_dict(ours.from_official(state), strict=True)
    assert torch.equal(ours.blocks[13].attn.mem_v, state["blocks.13.attn.linear_1.weight"].T)


def test_files_that_do_not_fit_eamlp_are_refused_with_the_keys_named(tmp_path):
    """T2T-ViT's own layout (tokens_type="performer" but MHSA blocks: ``attn.qkv``, a C x C ``proj``) and an EAMLP
    file with one block fewer: one message each, naming the missing, unexpected and mis-shaped keys."""
    official = T2TViT(32, 48, 2, 2, 3.0, 16, classes=10)
    ours = build_backbone({"name": "eamlp", **SMALL}, {"name": "external"}, num_classes=10, img_size=32)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    t2t = {k: v for k, v in official.state_dict().items() if not (k.startswith("blocks.") and ".attn." in k)}
    for i in range(2):  # T2T-ViT's transformer_block.Attention: qkv (3C, C) without bias, proj (C, C)
        t2t.update({f"blocks.{i}.attn.qkv.weight": torch.zeros(3 * 48, 48),
                    f"blocks.{i}.attn.proj.weight": torch.zeros(48, 48), f"blocks.{i}.attn.proj.bias": torch.zeros(48)})
    torch.save({"state_dict_ema": t2t, "state_dict": t2t, "epoch": 309}, tmp_path / "t2t_vit_14.pth.tar")
    with pytest.raises(UserError) as err:
        load_weights(ours, str(tmp_path / "t2t_vit_14.pth.tar"))
    message = str(err.value)
    assert "\n" not in message and f"model.weights={tmp_path / 't2t_vit_14.pth.tar'} does not fit" in message
    assert ("missing 8 (blocks.0.attn.mem_k, blocks.0.attn.mem_v, blocks.0.attn.q.weight, blocks.0.attn.q.bias, "
            "blocks.1.attn.mem_k and 3 more)") in message
    assert "unexpected 2 (blocks.0.attn.qkv.weight, blocks.1.attn.qkv.weight)" in message
    assert "wrong shape 2 (blocks.0.attn.proj.weight (48, 48) (the network's: (48, 192))" in message
    # EAMLP reads the EMA entry first (official_ema_keys), so that is the one described
    assert "a dict with keys ['state_dict_ema', 'state_dict', 'epoch'] whose 'state_dict_ema' is a state" in message
    assert "MenghaoGuo/EANet, EAMLP/: T2T_ViT with tokens_type='performer'" in message

    shallow = {k: v for k, v in official.state_dict().items() if not k.startswith("blocks.1.")}
    torch.save({"state_dict": shallow}, tmp_path / "eamlp_depth1.pth.tar")
    with pytest.raises(UserError) as err:
        load_weights(ours, str(tmp_path / "eamlp_depth1.pth.tar"))
    message = str(err.value)
    assert "nearest: its official key layout" in message and "unexpected none; wrong shape none" in message
    assert ("missing 14 (blocks.1.norm1.weight, blocks.1.norm1.bias, blocks.1.attn.mem_k, blocks.1.attn.mem_v, "
            "blocks.1.attn.q.weight and 9 more)") in message
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())  # a refused file changes nothing

    # A memory block whose projection is missing: linear_1's bias cannot be folded into it, and is named, not a crash.
    no_proj = {k: v for k, v in official.state_dict().items() if not k.startswith("blocks.1.attn.proj.")}
    torch.save({"state_dict": no_proj}, tmp_path / "eamlp_no_proj.pth.tar")
    with pytest.raises(UserError) as err:
        load_weights(ours, str(tmp_path / "eamlp_no_proj.pth.tar"))
    message = str(err.value)
    assert "missing 2 (blocks.1.attn.proj.weight, blocks.1.attn.proj.bias)" in message
    assert "unexpected 1 (blocks.1.attn.linear_1.bias)" in message


def test_memories_start_as_the_official_t2t_init():
    """The official memories are nn.Linear layers that T2T_ViT's _init_weights draws (t2t_vit.py): a normal truncated
    at +-2, std 0.02, zero-mean. In the 14 main blocks linear_0 and linear_1 are independent draws; the token blocks'
    linear_1 is a view of linear_0's storage (token_performer.py), so the two start equal there. Not EANet's tied
    N(0, 1/d) init, which the external variant keeps for itself."""
    torch.manual_seed(0)
    net = build_backbone({"name": "eamlp"}, {"name": "external"}, num_classes=1000, img_size=224)
    main = [(b.attn.mem_k, b.attn.mem_v) for b in net.blocks]
    assert len(main) == 14
    for k, v in main:
        assert not torch.equal(k, v)
        assert abs(torch.corrcoef(torch.stack([k.flatten(), v.flatten()]))[0, 1]) < 0.08  # 4096 pairs: sd 0.016
        for m in (k, v):  # 4096 draws each: the std's sampling error is 1.1%
            assert m.std().item() == pytest.approx(0.02, rel=0.05)
    pooled = torch.cat([m.flatten() for pair in main for m in pair])  # 114,688 draws: std within 0.2%
    assert pooled.std().item() == pytest.approx(0.02, rel=0.01) and abs(pooled.mean().item()) < 4 * 0.02 / 338
    for block in (net.tokens_to_token.block1, net.tokens_to_token.block2):
        k, v = block.attn.mem_k, block.attn.mem_v
        assert torch.equal(k, v) and k.data_ptr() != v.data_ptr()  # equal at the start, trained separately here
        assert k.std().item() == pytest.approx(0.02, rel=0.04)  # 8192 draws: sd 0.8%
    default = attention.build("external", dim=64, heads=1)  # the variant alone keeps EANet's tied init
    assert torch.equal(default.mem_k, default.mem_v)


def test_an_official_checkpoint_loads_its_ema_weights(tmp_path, caplog):
    """EAMLP's main.py evaluates load_checkpoint(model, path, args.model_ema) with model_ema on by default, and
    keeps the checkpoint whose EMA scored best: of timm's {"state_dict", "state_dict_ema"} the EMA is the model."""
    raw = randomise(T2TViT(32, 48, 2, 2, 3.0, 16, classes=10).double(), 0)
    ema = randomise(T2TViT(32, 48, 2, 2, 3.0, 16, classes=10).double(), 1)
    torch.save({"epoch": 299, "arch": "T2t_vit_14", "state_dict": raw.state_dict(),
                "state_dict_ema": ema.state_dict(), "metric": 78.9}, tmp_path / "model_best.pth.tar")
    ours = build_backbone({"name": "eamlp", **SMALL}, {"name": "external"}, num_classes=10, img_size=32).double()
    with caplog.at_level("INFO", logger="tasks.nets.weights"):
        assert load_weights(ours.eval(), str(tmp_path / "model_best.pth.tar")) == "official"
    assert "loading its 'state_dict_ema' entry, the EMA weights" in caplog.text and "(not 'state_dict')" in caplog.text
    expected = ours.from_official(ema.state_dict())
    assert all(torch.equal(v, expected[k]) for k, v in ours.state_dict().items())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ema(x), rtol=1e-9, atol=1e-9)

    # Without an EMA entry the raw weights load, as before, and nothing is said about an EMA.
    torch.save({"state_dict": raw.state_dict(), "epoch": 299}, tmp_path / "raw.pth.tar")
    caplog.clear()
    with caplog.at_level("INFO", logger="tasks.nets.weights"):
        load_weights(ours, str(tmp_path / "raw.pth.tar"))
    assert "EMA" not in caplog.text
    expected = ours.from_official(raw.state_dict())
    assert all(torch.equal(v, expected[k]) for k, v in ours.state_dict().items())
