"""Segmentation network: dilated backbones at output stride 8, every variant in the head, weights, optimiser."""

import os
from unittest import mock

import pytest
import torch
import torchvision
from torch import nn

import attention
from attention.errors import UserError
from tasks.nets.segnet import Backbone, SegNet
from tasks.segmentation import param_groups, poly_lambda

EXTERNAL = {"name": "external", "heads": 1, "memory": 8}


@pytest.mark.parametrize("name,channels", [("resnet18", (256, 512)), ("resnet50", (1024, 2048))])
def test_backbone_output_stride_8(name, channels):
    net = Backbone(name).eval()
    with torch.no_grad():
        c3, c4 = net(torch.randn(1, 3, 64, 48))
    assert c3.shape == (1, channels[0], 8, 6) and c4.shape == (1, channels[1], 8, 6)
    assert net.channels == channels
    dilations = {m.dilation for m in net.layer4.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)}
    # torchvision's first dilated Bottleneck keeps the previous rate (2); ours dilates every BasicBlock conv by 4
    assert dilations == ({(2, 2), (4, 4)} if name == "resnet50" else {(4, 4)})


def test_dilated_basic_backbone_equals_dilated_convolution_by_hand():
    """resnet18's layer4 dilated here computes what a stride-1, dilation-4 block computes, checked on block 2."""
    torch.manual_seed(0)
    net = Backbone("resnet18").eval()
    block = net.layer4[1]
    x = torch.randn(1, 512, 6, 6)
    with torch.no_grad():
        w = block.conv1.weight
        y = torch.nn.functional.conv2d(x, w, padding=4, dilation=4)
        assert torch.allclose(block.conv1(x), y, atol=1e-5)


@pytest.mark.parametrize("name", attention.names())
def test_every_variant_in_the_head(name):
    torch.manual_seed(0)
    net = SegNet(5, {**attention.options(name), "name": name}, backbone="resnet18", head_channels=32)
    image = torch.randn(2, 3, 40, 40)  # a 5x5 feature map
    logits, aux = net(image)
    assert logits.shape == (2, 5, 40, 40) and aux.shape == (2, 5, 40, 40)
    (logits.mean() + aux.mean()).backward()
    assert net.attention.mixer.dim == 32
    assert all(p.grad is not None for p in net.attention.parameters() if p.requires_grad)
    net.eval()
    with torch.no_grad():
        assert net(image).shape == (2, 5, 40, 40)  # evaluation: main logits only


def test_head_none_is_the_plain_fcn_and_aux_optional():
    plain = SegNet(3, EXTERNAL, backbone="resnet18", head="none", aux=False, head_channels=32)
    assert isinstance(plain.attention, nn.Identity) and plain.aux is None
    out = plain(torch.randn(2, 3, 32, 32))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 32, 32)
    with pytest.raises(UserError, match="model.head"):
        SegNet(3, EXTERNAL, backbone="resnet18", head="psp")
    with pytest.raises(UserError, match="model.backbone"):
        SegNet(3, EXTERNAL, backbone="vgg16")


def test_weights_from_a_file(tmp_path):
    torch.manual_seed(1)
    reference = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(reference.state_dict(), path)
    net = Backbone("resnet18", weights=str(path))
    assert torch.equal(net.layer4[1].conv2.weight, reference.layer4[1].conv2.weight)
    assert torch.equal(net.stem[1].running_var, reference.bn1.running_var)
    with pytest.raises(UserError, match="does not fit a resnet50"):
        Backbone("resnet50", weights=str(path))
    with pytest.raises(UserError, match="not a file"):
        Backbone("resnet18", weights=str(tmp_path / "missing.pth"))
    evil = tmp_path / "evil.pth"
    torch.save({"fn": os.system}, evil)
    with pytest.raises(UserError, match="weights_only"):
        Backbone("resnet18", weights=str(evil))


def test_pretrained_offline_says_where_to_put_the_file():
    enum = torchvision.models.ResNet50_Weights.IMAGENET1K_V1
    with mock.patch.object(type(enum), "get_state_dict", side_effect=OSError("network unreachable")):
        with pytest.raises(UserError) as err:
            Backbone("resnet50", pretrained=True)
    message = str(err.value)
    assert os.path.basename(enum.url) in message and "model.weights" in message and "model.pretrained=false" in message


def test_no_weight_decay_on_norms_and_biases():
    net = SegNet(3, EXTERNAL, backbone="resnet18", head_channels=32)
    decay, no_decay = param_groups(net, 1e-4)
    bn_weights = {id(m.weight) for m in net.modules() if isinstance(m, nn.BatchNorm2d)}
    assert bn_weights <= {id(p) for p in no_decay["params"]}
    assert all(p.dim() > 1 for p in decay["params"]) and decay["weight_decay"] == 1e-4
    assert no_decay["weight_decay"] == 0.0
    total = sum(p.numel() for p in net.parameters())
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == total


def test_poly_schedule():
    f = poly_lambda(100, 0.9)
    assert f(0) == 1.0 and f(100) == 0.0 and f(150) == 0.0
    assert f(50) == pytest.approx(0.5 ** 0.9)


def test_transformer_backbone_gives_full_resolution_logits(caplog):
    """model.backbone=dilateformer_t (reduced depths): stage 2 feeds the aux head, stages 3 + 4 the main head."""
    torch.manual_seed(0)
    net = SegNet(4, EXTERNAL, backbone="dilateformer_t", head_channels=32, crop=64, pretrained=True,
                 backbone_options={"depths": [1, 1, 1, 1]})
    assert "no ImageNet weights" in caplog.text
    assert net.backbone.channels == (144, 288 + 576)
    assert type(net.backbone.net.stages[0][0].block.attn).name == "dilated"  # native MSDA, head keeps attn
    logits, aux = net(torch.randn(2, 3, 64, 64))
    assert logits.shape == (2, 4, 64, 64) and aux.shape == (2, 4, 64, 64)
    (logits.mean() + aux.mean()).backward()
    assert net.backbone.net.stem[0].weight.grad is not None
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(1, 3, 50, 70)).shape == (1, 4, 50, 70)  # padded to 64x96, cropped back


def test_transformer_backbone_weights_and_attn(tmp_path):
    net = SegNet(3, EXTERNAL, backbone="vit_s", head_channels=32, crop=64, backbone_attn="same",
                 backbone_options={"depth": 1})
    assert type(net.backbone.net.blocks[0].attn).name == "external"
    path = tmp_path / "vit.pth"
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.backbone.net.state_dict().items()}}, path)
    again = SegNet(3, EXTERNAL, backbone="vit_s", head_channels=32, crop=64, backbone_attn="same",
                   backbone_options={"depth": 1}, weights=str(path))
    assert torch.equal(again.backbone.net.pos_embed, net.backbone.net.pos_embed)
    with pytest.raises(UserError, match="does not fit a vit_s"):
        SegNet(3, EXTERNAL, backbone="vit_s", crop=64, backbone_options={"depth": 2}, weights=str(path))


def test_poly_schedule_reads_a_counted_end_once_after_step_0():
    calls = []

    def count():
        calls.append(1)
        return 100

    f = poly_lambda(count, 0.9)
    assert f(0) == 1.0 and not calls  # the scheduler's first call, when it is made: nothing counted yet
    assert f(50) == pytest.approx(0.5 ** 0.9) and f(100) == 0.0 and len(calls) == 1


class _Seen(__import__("lightning").Callback):
    """The training batches' first pixels and the rate of every step; with ``stop_at``, a checkpoint at that step
    and a stop (a run interrupted mid-epoch)."""

    def __init__(self, stop_at=None, path=None):
        self.batches, self.lrs, self.stop_at, self.path = [], [], stop_at, path

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch["image"][:, 0, 0, 0].tolist())
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.stop_at:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def test_an_epoch_based_run_resumed_mid_epoch_continues_its_epoch(tmp_path):
    """trainer.max_steps=-1 with max_epochs: the poly schedule's end is Lightning's estimate of the steps. Read in
    configure_optimizers, it set up the training loader before the resumed run's state was restored, and Lightning
    then left out the loader's saved position: the resumed epoch started again from its first batch (the batches
    of before seen twice, the last ones never). Now the resumed run sees the batches and rates of the uninterrupted
    one."""
    import lightning as L

    from datamodules.segmentation.blobs import Blobs
    from suite.resume import RandomState
    from tasks.segmentation import Segmentation

    def fit(callback, ckpt=None):
        L.seed_everything(0, verbose=False)
        data = Blobs(num_train=6, num_val=2, num_test=2, size=32, batch_size=2, eval_batch_size=2)
        task = Segmentation(len(data.class_names), data.class_names, {"backbone": "resnet18", "head_channels": 8,
                                                                     "pretrained": False},
                            EXTERNAL, {"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01},
                                       "power": 0.9}, crop=(32, 32))
        trainer = L.Trainer(accelerator="cpu", max_epochs=2, max_steps=-1, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[callback, RandomState()])
        trainer.fit(task, datamodule=data, ckpt_path=ckpt)
        return trainer

    whole = _Seen()
    assert fit(whole).global_step == 6
    first, rest = _Seen(stop_at=2, path=tmp_path / "mid.ckpt"), _Seen()
    fit(first)
    fit(rest, ckpt=tmp_path / "mid.ckpt")
    assert first.batches + rest.batches == whole.batches
    assert first.lrs + rest.lrs == pytest.approx(whole.lrs, rel=1e-12)
    assert whole.lrs[1:] == pytest.approx([0.01 * (1 - k / 6) ** 0.9 for k in range(1, 6)], rel=1e-12)


def test_a_segmentation_run_without_an_end_is_refused_before_data():
    from omegaconf import OmegaConf

    from tasks.segmentation import Segmentation

    with pytest.raises(UserError, match="trainer.max_steps"):
        Segmentation.check_config(OmegaConf.create({"trainer": {"max_steps": -1, "max_epochs": -1}}))
    Segmentation.check_config(OmegaConf.create({"trainer": {"max_steps": -1, "max_epochs": 3}}))
