"""Focal-T/S against the official FocalTransformer of microsoft/Focal-Transformer@57bb303
(classification/focal_transformer.py: WindowAttention, FocalTransformerBlock with pool_method="fc" and no shift,
BasicLayer, PatchEmbed, FocalTransformer), transliterated here in float64 with the official attribute names, so
that its state dict is a released checkpoint's layout (eval mode: dropout and drop path are identities there and
are left out here)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attention
from attention import Grid, UserError
from tasks.nets.backbones import build_backbone
from tasks.nets.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# The official code, transliterated (float64, eval mode, pool_method "fc", shift 0)
# --------------------------------------------------------------------------------------------

def window_partition(x, ws):
    """(B, H, W, C) -> (B * nW, ws, ws, C), windows row-major per sample."""
    b, h, w, c = x.shape
    return x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, c)


def window_reverse(windows, ws, h, w):
    b = windows.shape[0] // ((h // ws) * (w // ws))
    return windows.view(b, h // ws, w // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def get_relative_position_index(q_windows, k_windows):
    qh, qw = torch.meshgrid(torch.arange(q_windows[0]), torch.arange(q_windows[1]), indexing="ij")
    kh, kw = torch.meshgrid(torch.arange(k_windows[0]), torch.arange(k_windows[1]), indexing="ij")
    dr = qh.flatten()[:, None] - kh.flatten()[None, :] + k_windows[0] - 1
    dc = qw.flatten()[:, None] - kw.flatten()[None, :] + k_windows[1] - 1
    return dr * (q_windows[1] + k_windows[1] - 1) + dc


class WindowAttention(nn.Module):
    def __init__(self, dim, expand_size, window_size, focal_window, focal_level, num_heads):
        super().__init__()
        self.dim, self.expand_size, self.window_size = dim, expand_size, window_size
        self.num_heads, self.focal_level, self.focal_window = num_heads, focal_level, focal_window
        self.scale = (dim // num_heads) ** -0.5
        ws = window_size[0]
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", get_relative_position_index((ws, ws), (ws, ws)))
        if expand_size > 0 and focal_level > 0:
            keys = 4 * ws * ws - 4 * (ws - expand_size) ** 2
            self.relative_position_bias_table_to_neighbors = nn.Parameter(torch.zeros(1, num_heads, ws * ws, keys))
            e = expand_size
            masks = [torch.ones(ws, ws) for _ in range(4)]  # tl, tr, bl, br: 0 where the rolled token is inside
            masks[0][:-e, :-e] = 0
            masks[1][:-e, e:] = 0
            masks[2][e:, :-e] = 0
            masks[3][e:, e:] = 0
            self.register_buffer("valid_ind_rolled", torch.stack(masks).flatten().nonzero().view(-1))
        if focal_level > 1:
            self.relative_position_bias_table_to_windows = nn.ParameterList()
            self.unfolds = nn.ModuleList()
            for k in range(focal_level - 1):
                kernel = 2 * (focal_window // 2) + 2 ** k + (2 ** k - 1)
                self.unfolds.append(nn.Unfold(kernel_size=(kernel, kernel), stride=2 ** k, padding=kernel // 2))
                side = focal_window + 2 ** k - 1
                self.relative_position_bias_table_to_windows.append(
                    nn.Parameter(torch.zeros(num_heads, (ws + side - 1) ** 2)))
                self.register_buffer(f"relative_position_index_{k}", get_relative_position_index((ws, ws), (side, side)))
                if k > 0:
                    mask = torch.zeros(kernel, kernel)
                    mask[2 ** k - 1:, 2 ** k - 1:] = 1
                    self.register_buffer(f"valid_ind_unfold_{k}", mask.flatten().nonzero().view(-1))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_all, mask_all):
        x = x_all[0]
        B, nH, nW, C = x.shape
        ws, heads, d = self.window_size[0], self.num_heads, C // self.num_heads
        q, k, v = self.qkv(x).reshape(B, nH, nW, 3, C).permute(3, 0, 1, 2, 4)  # each (B, nH, nW, C)
        q_windows, k_windows, v_windows = (window_partition(t, ws).view(-1, ws * ws, heads, d).transpose(1, 2)
                                           for t in (q, k, v))
        if self.expand_size > 0 and self.focal_level > 0:
            e = self.expand_size
            rolled = []
            for t, t_windows in ((k, k_windows), (v, v_windows)):
                copies = [window_partition(torch.roll(t, shifts=s, dims=(1, 2)), ws).view(-1, ws * ws, heads, d)
                          for s in ((-e, -e), (-e, e), (e, -e), (e, e))]  # tl, tr, bl, br
                t_rolled = torch.cat(copies, 1).transpose(1, 2)[:, :, self.valid_ind_rolled]  # tokens in the window out
                rolled.append(torch.cat((t_windows, t_rolled), 2))
            k_rolled, v_rolled = rolled
        else:
            k_rolled, v_rolled = k_windows, v_windows
        k_pooled, v_pooled = [], []
        for level in range(self.focal_level - 1):
            stride, unfold = 2 ** level, self.unfolds[level]
            pooled = x_all[level + 1]  # (B, nWh, nWw, C)
            nWh, nWw = pooled.shape[1:3]
            kernel = unfold.kernel_size[0]
            mask = unfold(pooled.new_ones(1, 1, nWh, nWw)).view(1, 1, kernel, kernel, -1).permute(0, 4, 2, 3, 1)
            mask = mask.reshape(nWh * nWw // stride // stride, -1, 1)
            if level > 0:
                valid = getattr(self, f"valid_ind_unfold_{level}")
                mask = mask[:, valid]
            mask = mask.flatten(1).unsqueeze(0)
            mask_all[level + 1] = mask.masked_fill(mask == 0, -100.0).masked_fill(mask > 0, 0.0)
            qkv_pooled = self.qkv(pooled).reshape(B, nWh, nWw, 3, C).permute(3, 0, 4, 1, 2)  # each (B, C, nWh, nWw)
            kv = []
            for t in (qkv_pooled[1], qkv_pooled[2]):
                t = unfold(t).view(B, C, kernel, kernel, -1).permute(0, 4, 2, 3, 1).reshape(
                    -1, kernel * kernel, heads, d).transpose(1, 2)
                kv.append(t[:, :, valid] if level > 0 else t)
            k_pooled.append(kv[0])
            v_pooled.append(kv[1])
        k_all = torch.cat([k_rolled] + k_pooled, 2)
        v_all = torch.cat([v_rolled] + v_pooled, 2)

        attn = (q_windows * self.scale) @ k_all.transpose(-2, -1)
        area, area_rolled = ws * ws, k_rolled.shape[2]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(area, area, -1)
        attn[:, :, :area, :area] = attn[:, :, :area, :area] + bias.permute(2, 0, 1).unsqueeze(0)
        if self.expand_size > 0 and self.focal_level > 0:
            attn[:, :, :area, area:area_rolled] = attn[:, :, :area, area:area_rolled] + \
                self.relative_position_bias_table_to_neighbors
        offset = area_rolled
        for level in range(self.focal_level - 1):
            n = (self.focal_window + 2 ** level - 1) ** 2
            index = getattr(self, f"relative_position_index_{level}")
            bias = self.relative_position_bias_table_to_windows[level][:, index.view(-1)].view(-1, area, n)
            attn[:, :, :area, offset:offset + n] = attn[:, :, :area, offset:offset + n] + bias.unsqueeze(0)
            m = mask_all[level + 1]
            attn[:, :, :area, offset:offset + n] = attn[:, :, :area, offset:offset + n] + \
                m[:, :, None, None, :].repeat(attn.shape[0] // m.shape[1], 1, 1, 1, 1).view(-1, 1, 1, m.shape[-1])
            offset += n
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v_all).transpose(1, 2).reshape(attn.shape[0], area, C))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class FocalTransformerBlock(nn.Module):
    def __init__(self, dim, input_resolution, num_heads, window_size, expand_size, focal_level, focal_window):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size, self.expand_size, self.focal_level = window_size, expand_size, focal_level
        if min(input_resolution) <= window_size:  # one window over the map, no expansion
            self.expand_size, self.window_size = 0, min(input_resolution)
        self.window_size_glo = self.window_size
        self.pool_layers = nn.ModuleList()
        for k in range(focal_level - 1):
            g = math.floor(self.window_size_glo / 2 ** k)
            self.pool_layers.append(nn.Linear(g * g, 1))
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, self.expand_size, (self.window_size, self.window_size), focal_window,
                                    focal_level, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)

    def attend(self, x):
        """The block's attention branch on the normed tokens x (B, L, C): pad, pool, WindowAttention, crop."""
        H0, W0 = self.input_resolution
        B, L, C = x.shape
        ws = self.window_size
        x = x.view(B, H0, W0, C)
        x = F.pad(x, (0, 0, 0, (ws - W0 % ws) % ws, 0, (ws - H0 % ws) % ws))
        H, W = x.shape[1:3]
        x_windows_all, masks = [x], [None]
        for k in range(self.focal_level - 1):
            g = math.floor(self.window_size_glo / 2 ** k)
            H_pool, W_pool = math.ceil(H / ws) * 2 ** k * g, math.ceil(W / ws) * 2 ** k * g
            x_level_k = x
            if H > H_pool:
                top = (H - H_pool) // 2
                x_level_k = x_level_k[:, top:-(H - H_pool - top)]
            if W > W_pool:
                left = (W - W_pool) // 2
                x_level_k = x_level_k[:, :, left:-(W - W_pool - left)]
            nWh, nWw = x_level_k.shape[1] // g, x_level_k.shape[2] // g
            windows = x_level_k.reshape(B, nWh, g, nWw, g, C).permute(0, 1, 3, 2, 4, 5)
            windows = windows.reshape(B, nWh, nWw, g * g, C).transpose(3, 4)  # (B, nWh, nWw, C, g*g)
            x_windows_all.append(self.pool_layers[k](windows).flatten(-2))
            masks.append(None)
        out = self.attn(x_windows_all, masks)[:, :ws * ws].view(-1, ws, ws, C)
        return window_reverse(out, ws, H, W)[:, :H0, :W0].reshape(B, L, C)

    def forward(self, x):
        x = x + self.attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, in_chans, embed_dim, use_conv_embed, is_stem):
        super().__init__()
        if use_conv_embed:
            kernel, padding, stride = (7, 2, 4) if is_stem else (3, 1, 2)
            self.proj = nn.Conv2d(in_chans, embed_dim, kernel, stride, padding)
        else:
            self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x):
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class BasicLayer(nn.Module):
    def __init__(self, dim, input_resolution, depth, num_heads, window_size, expand_size, focal_level,
                 focal_window, use_conv_embed, downsample):
        super().__init__()
        self.input_resolution = input_resolution
        self.blocks = nn.ModuleList([FocalTransformerBlock(dim, input_resolution, num_heads, window_size,
                                                           expand_size, focal_level, focal_window)
                                     for _ in range(depth)])
        self.downsample = PatchEmbed(2, dim, 2 * dim, use_conv_embed, False) if downsample else None

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        if self.downsample is not None:
            x = x.view(x.shape[0], *self.input_resolution, -1).permute(0, 3, 1, 2)
            x = self.downsample(x)
        return x


class FocalTransformer(nn.Module):
    def __init__(self, img_size, num_classes, embed_dim, depths, num_heads, window_size, focal_levels,
                 focal_windows, expand_sizes, use_conv_embed=False):
        super().__init__()
        self.patch_embed = PatchEmbed(4, 3, embed_dim, use_conv_embed, True)
        res = img_size // 4
        self.layers = nn.ModuleList([
            BasicLayer(embed_dim * 2 ** i, (res // 2 ** i, res // 2 ** i), depths[i], num_heads[i], window_size,
                       expand_sizes[i], focal_levels[i], focal_windows[i], use_conv_embed, i < len(depths) - 1)
            for i in range(len(depths))])
        self.norm = nn.LayerNorm(embed_dim * 2 ** (len(depths) - 1))
        self.head = nn.Linear(embed_dim * 2 ** (len(depths) - 1), num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if "relative_position" in name else 0.1
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
                    + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return module.eval()


# --------------------------------------------------------------------------------------------
# The mixer: border=roll is the official block's attention branch
# --------------------------------------------------------------------------------------------

MIXER_CASES = [  # (H, W, ws, e, focal_level, focal_window): maps not multiples of the window (padding, trims)
    (13, 10, 7, 3, 2, 7),  # Focal-T's stage 1 options: 14 x 14 padded map, 2 x 2 windows, every one at a border
    (11, 13, 4, 2, 3, 3),  # two coarse levels: valid_ind_unfold and the -100 mask of the second
    (9, 17, 5, 1, 3, 1),  # the official trim of the pooled map (2 * floor(5 / 2) < 5)
]


@pytest.mark.parametrize("h,w,ws,e,level,fw", MIXER_CASES)
def test_roll_is_the_official_window_attention(h, w, ws, e, level, fw):
    dim, heads = 16, 2
    official = randomise(FocalTransformerBlock(dim, (h, w), heads, ws, e, level, fw).double(), h * w)
    mixer = attention.build("focal", dim=dim, heads=heads, window_size=ws, expand_size=e, focal_level=level,
                            focal_window=fw, border="roll").double().eval()
    mixer.load_state_dict({k[len("attn."):] if k.startswith("attn.") else k: v
                           for k, v in official.state_dict().items()
                           if k.startswith(("attn.", "pool_layers.")) and "index" not in k and "valid_ind" not in k})
    x = torch.randn(2, h * w, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = official.attend(x)
        torch.testing.assert_close(mixer(x, Grid(h, w)), expected, rtol=1e-12, atol=1e-12)
        masked = attention.build("focal", dim=dim, heads=heads, window_size=ws, expand_size=e, focal_level=level,
                                 focal_window=fw, border="mask").double().eval()
        masked.load_state_dict(mixer.state_dict())
        assert (masked(x, Grid(h, w)) - expected).abs().max() > 1e-3  # the masked borders are another function


# --------------------------------------------------------------------------------------------
# The network: official checkpoints load and give the official outputs
# --------------------------------------------------------------------------------------------

SMALL = dict(embed_dim=32, depths=[2, 1, 1, 1], heads=[2, 2, 4, 4])  # maps 16, 8, 4, 2 at 64: rolls with
# padding (16 -> 21, 8 -> 14), then the official shrink (4 and 2 <= 7: one window, no expansion)


def official_small(use_conv_embed):
    return FocalTransformer(64, 10, SMALL["embed_dim"], SMALL["depths"], SMALL["heads"], 7, [2, 2, 2, 2],
                            [7, 5, 3, 1], [3, 3, 3, 3], use_conv_embed)


@pytest.mark.parametrize("use_conv_embed", [False, True])
def test_official_focal_file_loads_and_computes_the_official_function(tmp_path, use_conv_embed):
    official = randomise(official_small(use_conv_embed).double(), 3)
    path = tmp_path / "focal-tiny-is224-ws7.pth"
    torch.save({"model": official.state_dict(), "epoch": 299}, path)
    ours = build_backbone({"name": "focal_t", **SMALL, "use_conv_embed": use_conv_embed}, {"name": "focal"},
                          num_classes=10, img_size=64).double()
    assert [s.blocks[0].attn.border for s in ours.stages] == ["roll"] * 4  # the model's preset
    assert load_weights(ours.eval(), str(path)) == "official"
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = official(x)
        torch.testing.assert_close(ours(x), expected, rtol=1e-9, atol=1e-9)
        masked = build_backbone({"name": "focal_t", **SMALL, "use_conv_embed": use_conv_embed, "border": "mask"},
                                {"name": "focal"}, num_classes=10, img_size=64).double().eval()
        load_weights(masked, str(path))
        assert (masked(x) - expected).abs().max() > 1e-4  # model.border=mask is not the official function


def test_focal_t_keys_and_parameters_are_the_official_ones():
    """Focal-T at 224: every official tensor but the index buffers is a parameter here, with its shape."""
    official = FocalTransformer(224, 1000, 96, [2, 2, 6, 2], [3, 6, 12, 24], 7, [2, 2, 2, 2], [7, 5, 3, 1],
                                [3, 3, 3, 3])
    ours = build_backbone({"name": "focal_t"}, {"name": "focal"}, num_classes=1000, img_size=224)
    counted = sum(p.numel() for p in official.parameters())
    assert counted == sum(p.numel() for p in ours.parameters())
    assert abs(counted / 1e6 - 28.9) < 0.05
    mapped = ours.from_official(official.state_dict())
    own = ours.state_dict()
    assert sorted(mapped) == sorted(own) and all(mapped[k].shape == own[k].shape for k in own)



def test_focal_s_released_layout_is_placed_key_for_key():
    """Focal-S at 224 (configs/focal_small_patch4_window7_224.yaml: depths [2, 2, 18, 2]), in the layout of
    focal-small-is224-ws7.pth: 496 tensors, of which the 70 index buffers (functions of the window sizes) are
    dropped and the other 426 each placed on one of ours, shapes equal; 51.1M parameters on both sides."""
    official = FocalTransformer(224, 1000, 96, [2, 2, 18, 2], [3, 6, 12, 24], 7, [2, 2, 2, 2], [7, 5, 3, 1],
                                [3, 3, 3, 3])
    ours = build_backbone({"name": "focal_s"}, {"name": "focal"}, num_classes=1000, img_size=224)
    counted = sum(p.numel() for p in official.parameters())
    assert counted == sum(p.numel() for p in ours.parameters()) == 51_141_940
    state = official.state_dict()
    released = {  # names and shapes as released, at the stages' edges: expansion, pooling, the one-window stage 4
        "patch_embed.proj.weight": (96, 3, 4, 4),
        "layers.0.blocks.0.attn.relative_position_bias_table_to_neighbors": (1, 3, 49, 132),
        "layers.0.blocks.0.attn.relative_position_bias_table_to_windows.0": (3, 169),
        "layers.0.blocks.0.pool_layers.0.weight": (1, 49),
        "layers.2.blocks.17.attn.qkv.weight": (1152, 384),
        "layers.2.downsample.proj.weight": (768, 384, 2, 2),
        "layers.3.blocks.1.attn.relative_position_bias_table": (169, 24),
        "layers.3.blocks.1.attn.relative_position_bias_table_to_windows.0": (24, 49),
        "head.weight": (1000, 768),
    }
    assert {k: tuple(state[k].shape) for k in released} == released
    assert "layers.3.blocks.1.attn.relative_position_bias_table_to_neighbors" not in state  # 7 x 7: no expansion
    buffers = [k for k in state if k.split(".")[-1].startswith(("relative_position_index", "valid_ind_"))]
    assert len(state) == 496 and len(buffers) == 70
    g = torch.Generator().manual_seed(0)
    state.update({k: torch.randn(state[k].shape, generator=g) for k in released})  # tell the placed tensors apart
    mapped, own = ours.from_official(state), ours.state_dict()
    assert len(mapped) == len(state) - len(buffers) == len(own) == 426
    assert sorted(mapped) == sorted(own) and all(mapped[k].shape == own[k].shape for k in own)
    ours.load_state_dict(mapped, strict=True)
    placed = {"patch_embed.proj.weight": "stem.proj.weight",
              "layers.0.blocks.0.attn.relative_position_bias_table_to_neighbors":
                  "stages.0.blocks.0.attn.relative_position_bias_table_to_neighbors",
              "layers.0.blocks.0.pool_layers.0.weight": "stages.0.blocks.0.attn.pool_layers.0.weight",
              "layers.2.blocks.17.attn.qkv.weight": "stages.2.blocks.17.attn.qkv.weight",
              "layers.2.downsample.proj.weight": "downsamples.2.proj.weight",
              "layers.3.blocks.1.attn.relative_position_bias_table_to_windows.0":
                  "stages.3.blocks.1.attn.relative_position_bias_table_to_windows.0",
              "head.weight": "head.weight"}
    loaded = ours.state_dict()
    assert all(torch.equal(loaded[o], state[k]) for k, o in placed.items())

def test_a_wrong_file_gets_the_loaders_message(tmp_path):
    official = official_small(False)
    state = official.state_dict()
    state["layers.0.blocks.0.attn.qkv.weight"] = state["layers.0.blocks.0.attn.qkv.weight"][:, :16]
    del state["head.bias"]
    torch.save({"model": state}, tmp_path / "focal-small.pth")
    ours = build_backbone({"name": "focal_t", **SMALL}, {"name": "focal"}, num_classes=10, img_size=64)
    with pytest.raises(UserError, match=r"model.weights=.*does not fit.*nearest: its official key layout.*"
                                        r"missing 1 \(head.bias\).*wrong shape 1 \(stages.0.blocks.0.attn.qkv.weight"):
        load_weights(ours, str(tmp_path / "focal-small.pth"))


def test_pools_are_drawn_as_the_official_focal_transformer():
    """The official block fills each 'fc' pool with 1/49 (focal_transformer.py:531-533), but FocalTransformer's
    self.apply(self._init_weights) then draws every Linear, the pools included: a normal truncated at +-2 with std
    0.02, bias 0. The focal variant on its own keeps the mean (other networks have no official pool init)."""
    torch.manual_seed(0)
    net = build_backbone({"name": "focal_t"}, {"name": "focal"}, num_classes=1000, img_size=224)
    pools = [pool for stage in net.stages for block in stage.blocks for pool in block.attn.pool_layers]
    assert len(pools) == 12 and all(p.weight.shape == (1, 49) and not p.bias.any() for p in pools)
    w = torch.cat([p.weight.flatten() for p in pools])  # 588 draws: the std's sampling error is 2.9%
    assert w.std().item() == pytest.approx(0.02, rel=0.12) and abs(w.mean().item()) < 4 * 0.02 / 588 ** 0.5
    assert net.head.weight.std().item() == pytest.approx(0.02, rel=0.01)
    alone = attention.build("focal", dim=32, heads=2)
    assert torch.equal(alone.pool_layers[0].weight, torch.full((1, 49), 1 / 49))
