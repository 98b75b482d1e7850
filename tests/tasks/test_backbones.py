"""ImageNet backbones: published sizes, every attention variant in every model, features, input checks."""

import inspect
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

import attention
from attention.errors import UserError
from tasks.nets import backbones
from tasks.nets.backbones import MODELS, NATIVE_ATTN, Backbone, build_backbone, native_attn
from tasks.nets.backbones.common import attn_defaults

pytestmark = pytest.mark.usefixtures("one_thread")

PUBLISHED_PARAMS = {  # millions, from the papers / official READMEs
    "dilateformer_t": 17.2, "dilateformer_s": 24.2, "dilateformer_b": 47.2,
    "focal_t": 28.9, "focal_s": 51.1, "eamlp": 30.0, "vit_s": 22.1,
}
SMALL = {  # reduced depths, full widths
    "dilateformer_t": {"depths": [1, 1, 1, 1]}, "dilateformer_s": {"depths": [1, 1, 1, 1]},
    "dilateformer_b": {"depths": [1, 1, 1, 1]}, "focal_t": {"depths": [1, 1, 1, 1]},
    "focal_s": {"depths": [1, 1, 1, 1]}, "eamlp": {"depth": 1}, "vit_s": {"depth": 1},
}


def attn_cfg(name: str, **extra) -> dict:
    return {"name": name, **attn_defaults(name), **extra}


def small(model: str, attn: dict, **overrides):
    return build_backbone({"name": model, **SMALL[model], **overrides}, attn, num_classes=7, img_size=64)


def test_focal_t_has_the_published_params_and_flops():
    """Focal-T: 28.9M parameters and 4.9 GMACs at 224 (flop_counter counts 2 FLOPs per multiply-add)."""
    net = build_backbone({"name": "focal_t"}, native_attn("focal_t"), num_classes=1000, img_size=224).eval()
    params = sum(p.numel() for p in net.parameters())
    assert abs(params / 1e6 - 28.9) < 0.05
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(torch.zeros(1, 3, 224, 224))
    gmacs = counter.get_total_flops() / 2e9
    assert gmacs == pytest.approx(4.9, rel=0.02)


@pytest.mark.parametrize("model", [m for m in MODELS if m != "focal_t"])
def test_param_counts_match_the_papers(model):
    attn = native_attn(model)
    device = "cpu" if NATIVE_ATTN[model] == "focal" else "meta"  # the focal mixer's index tables need data
    with torch.device(device):
        net = build_backbone({"name": model}, attn, num_classes=1000, img_size=224)
    params = sum(p.numel() for p in net.parameters())
    assert params / 1e6 == pytest.approx(PUBLISHED_PARAMS[model], rel=0.03)


@pytest.mark.parametrize("variant", attention.names())
@pytest.mark.parametrize("model", MODELS)
def test_every_variant_in_every_model(model, variant):
    """Forward + backward at 64x64 with reduced depths: logits finite, gradients reach the stem."""
    torch.manual_seed(0)
    attn = attn_cfg(variant)
    if variant == "dilated" and NATIVE_ATTN[model] != "dilated":
        # 4 head groups (configs/attn/dilated.yaml) do not divide 3- or 6-head stages: a clear error, then the fix
        with pytest.raises(UserError, match=rf"model={model}.*(stage|block) 1.*'dilated'"):
            small(model, attn)
        attn = attn_cfg(variant, dilations=[1, 2, 3])
    net = small(model, attn)
    x = torch.randn(2, 3, 64, 64)
    logits = net(x)
    assert logits.shape == (2, 7) and torch.isfinite(logits).all()
    logits.square().mean().backward()
    stem = next(p for n, p in net.named_parameters() if n.startswith(("stem.", "patch_embed.", "tokens_to_token.")))
    assert stem.grad is not None and stem.grad.abs().sum() > 0


@pytest.mark.parametrize("model", MODELS)
def test_features_match_channels_and_strides(model):
    net = small(model, native_attn(model)).eval()
    with torch.no_grad():
        features = net.forward_features(torch.randn(1, 3, 64, 96))
    assert len(features) == len(net.feature_channels) == len(net.feature_strides)
    for f, c, s in zip(features, net.feature_channels, net.feature_strides):
        assert f.shape == (1, c, 64 // s, 96 // s)
    assert net.num_features == net.feature_channels[-1]
    head_free = build_backbone({"name": model, **SMALL[model]}, native_attn(model), num_classes=0, img_size=64)
    assert head_free(torch.randn(1, 3, 64, 64)).shape == (1, net.num_features)


def test_input_size_is_checked_and_padding_takes_any_size():
    net = small("focal_t", native_attn("focal_t"))
    with pytest.raises(UserError, match=r"data\.img_size.*multiples of 32.*64, 96.*model\.pad=true"):
        net(torch.zeros(1, 3, 70, 64))
    with pytest.raises(UserError, match="data.img_size"):
        net.check_input(64, 48)
    padded = small("focal_t", native_attn("focal_t"), pad=True)
    assert padded(torch.zeros(1, 3, 70, 50)).shape == (1, 7)
    with pytest.raises(UserError, match=r"model=vit_s.*multiples of 16"):
        small("vit_s", native_attn("vit_s"))(torch.zeros(1, 3, 40, 48))


def test_unknown_model_and_options_are_user_errors():
    with pytest.raises(UserError) as err:
        build_backbone({"name": "resnet9"}, native_attn("vit_s"), num_classes=3, img_size=64)
    assert all(m in str(err.value) for m in MODELS)
    with pytest.raises(UserError, match="model.widths"):
        build_backbone({"name": "focal_t", "widths": 3}, native_attn("focal_t"), num_classes=3, img_size=64)
    with pytest.raises(UserError, match=r"model\.heads.*4 stages"):
        small("dilateformer_t", native_attn("dilateformer_t"), heads=[3, 6])


def test_global_attn_replaces_the_global_stages_only():
    net = small("dilateformer_t", native_attn("dilateformer_t"), global_attn="external")
    mixers = [stage[0].block.attn for stage in net.stages]
    assert [type(m).name for m in mixers] == ["dilated", "dilated", "external", "external"]
    assert [m.heads for m in mixers] == [3, 6, 12, 24]
    plain = small("dilateformer_t", native_attn("dilateformer_t"))
    assert [type(stage[0].block.attn).name for stage in plain.stages] == ["dilated", "dilated", "self", "self"]


def test_paper_presets_apply_unless_the_option_was_set():
    net = small("dilateformer_t", native_attn("dilateformer_t"))
    assert net.stages[0][0].block.attn.dilations == (1, 2, 3)  # the paper's, not configs/attn/dilated.yaml's
    mine = small("dilateformer_t", attn_cfg("dilated", dilations=[1, 3]), heads=[2, 4, 12, 24])
    assert mine.stages[0][0].block.attn.dilations == (1, 3)
    focal = build_backbone({"name": "focal_t"}, native_attn("focal_t"), num_classes=0, img_size=224)
    windows = [(s.blocks[0].attn.focal_window, s.blocks[0].attn.expand_size) for s in focal.stages]
    assert windows == [(7, 3), (5, 3), (3, 3), (1, 0)]  # stage 4 at 224 is one 7x7 window, no expansion


# --------------------------------------------------------------------------------------------
# The registry and the one home of each architecture (configs/model/<name>.yaml)
# --------------------------------------------------------------------------------------------

MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "model"


def test_every_model_yaml_is_a_registered_backbone():
    assert sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml")) == backbones.names() == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_the_yaml_holds_every_option_and_the_constructor_defaults_none(model):
    """The architecture is written once: the yaml's keys are the constructor's keyword-only options, none of which
    has a default, so nothing in Python can drift from the file."""
    params = inspect.signature(backbones.get(model).__init__).parameters.values()
    options = {p.name: p for p in params if p.kind == p.KEYWORD_ONLY}
    assert set(options) == set(backbones.spec(model))
    assert all(p.default is inspect.Parameter.empty for p in options.values())


@pytest.mark.parametrize("model", MODELS)
def test_the_yaml_picks_the_class_native_mixer(model):
    with initialize_config_dir(config_dir=str(MODEL_CONFIGS.parent), version_base="1.3"):
        cfg = compose("config", overrides=["task=classification", f"model={model}"])
    assert cfg.model.name == model and cfg.attn.name == backbones.get(model).native_attn == NATIVE_ATTN[model]
    from tasks.classification import ImageClassification

    composed = {k: v for k, v in OmegaConf.to_container(cfg.model).items()
                if k != "name" and k not in ImageClassification.weights_options}  # model.weights: a file, not a spec
    assert composed == backbones.spec(model)  # what a classification run gets is what a segmentation one gets


def test_register_rejects_a_second_class_under_a_name():
    existing = backbones.get("vit_s")

    class Impostor(Backbone):
        pass

    with pytest.raises(KeyError, match="vit_s"):
        backbones.register("vit_s")(Impostor)
    assert backbones.get("vit_s") is existing
    assert backbones.register("vit_s")(existing) is existing
