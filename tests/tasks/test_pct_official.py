"""PCT against PCT_Pytorch's ``Pct`` (Strawberry-Eat-Mango/PCT_Pytorch@0199a3b, model.py + util.py), in float64.

The official network is transliterated below module by module, with the official attribute names, so its
``state_dict()`` has exactly the keys and shapes of a released ``model.t7``; that file (saved from
``nn.DataParallel``, hence ``module.``) is loaded through ``model.weights``' loader, and both networks must give
the same logits. Its FPS is pointnet2_ops' CUDA kernel, written here as a loop over samples.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tasks.nets.pct import PCT
from tasks.nets.weights import load_weights


def kernel_fps(xyz, m):
    """pointnet2_ops' furthest_point_sample for inputs without ties: start at 0, never take |p|^2 <= 1e-3."""
    b, n, _ = xyz.shape
    out = torch.zeros(b, m, dtype=torch.long)
    for s in range(b):
        temp = torch.full((n,), 1e10, dtype=xyz.dtype)
        skipped = xyz[s].square().sum(-1) <= 1e-3
        old = 0
        for j in range(1, m):
            temp = torch.minimum(temp, (xyz[s] - xyz[s, old]).square().sum(-1))
            old = int(torch.where(skipped, -1.0, temp).argmax())
            out[s, j] = old
    return out


def index_points(points, idx):
    return points[torch.arange(points.shape[0]).view(-1, *([1] * (idx.dim() - 1))), idx]


def sample_and_group(npoint, nsample, xyz, points):
    new_xyz = index_points(xyz, kernel_fps(xyz, npoint))
    new_points = index_points(points, kernel_fps(xyz, npoint))
    dists = torch.cdist(new_xyz, xyz).square()
    grouped = index_points(points, dists.topk(nsample, largest=False).indices)  # (B, S, K, C)
    centre = new_points.unsqueeze(2)
    return new_xyz, torch.cat([grouped - centre, centre.expand_as(grouped)], dim=-1)


class LocalOp(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 1, bias=False)
        self.conv2 = nn.Conv1d(cout, cout, 1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm1d(cout), nn.BatchNorm1d(cout)

    def forward(self, x):
        b, n, s, d = x.shape
        x = x.permute(0, 1, 3, 2).reshape(-1, d, s)
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        return x.amax(-1).reshape(b, n, -1).permute(0, 2, 1)


class SALayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.q_conv = nn.Conv1d(c, c // 4, 1, bias=False)
        self.k_conv = nn.Conv1d(c, c // 4, 1, bias=False)
        self.q_conv.weight = self.k_conv.weight
        self.v_conv, self.trans_conv = nn.Conv1d(c, c, 1), nn.Conv1d(c, c, 1)
        self.after_norm = nn.BatchNorm1d(c)

    def forward(self, x):
        energy = torch.bmm(self.q_conv(x).permute(0, 2, 1), self.k_conv(x))
        attention = energy.softmax(-1)
        attention = attention / (1e-9 + attention.sum(dim=1, keepdim=True))
        x_r = torch.bmm(self.v_conv(x), attention)
        return x + F.relu(self.after_norm(self.trans_conv(x - x_r)))


class PointTransformerLast(nn.Module):
    def __init__(self, c=256):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(c, c, 1, bias=False), nn.Conv1d(c, c, 1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm1d(c), nn.BatchNorm1d(c)
        self.sa1, self.sa2, self.sa3, self.sa4 = (SALayer(c) for _ in range(4))

    def forward(self, x):
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        x1 = self.sa1(x)
        x2 = self.sa2(x1)
        x3 = self.sa3(x2)
        return torch.cat([x1, x2, x3, self.sa4(x3)], dim=1)


class OfficialPct(nn.Module):
    def __init__(self, classes=40):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(3, 64, 1, bias=False), nn.Conv1d(64, 64, 1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm1d(64), nn.BatchNorm1d(64)
        self.gather_local_0, self.gather_local_1 = LocalOp(128, 128), LocalOp(256, 256)
        self.pt_last = PointTransformerLast()
        self.conv_fuse = nn.Sequential(nn.Conv1d(1280, 1024, 1, bias=False), nn.BatchNorm1d(1024), nn.LeakyReLU(0.2))
        self.linear1, self.bn6 = nn.Linear(1024, 512, bias=False), nn.BatchNorm1d(512)
        self.linear2, self.bn7 = nn.Linear(512, 256), nn.BatchNorm1d(256)
        self.linear3 = nn.Linear(256, classes)

    def forward(self, x):  # x (B, 3, N), as the reference feeds it
        xyz = x.permute(0, 2, 1)
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))).permute(0, 2, 1)
        new_xyz, grouped = sample_and_group(512, 32, xyz, x)
        feature_0 = self.gather_local_0(grouped)
        _, grouped = sample_and_group(256, 32, new_xyz, feature_0.permute(0, 2, 1))
        feature_1 = self.gather_local_1(grouped)
        x = self.conv_fuse(torch.cat([self.pt_last(feature_1), feature_1], dim=1)).amax(-1)
        x = F.leaky_relu(self.bn6(self.linear1(x)), 0.2)
        x = F.leaky_relu(self.bn7(self.linear2(x)), 0.2)
        return self.linear3(x)


def released_state(seed=0):
    """A model.t7 as PCT_Pytorch's main.py writes it: DataParallel keys, random weights and BN statistics.

    At scales that keep the signal alive through the network (weights of variance 2 / fan-in, BN scales and
    variances in [0.5, 1.5]): with weights near 0.1 the logits are ~0.1 and the attention nearly uniform, so that
    leaving out offset attention's column normalisation would move them by less than the tolerance."""
    g = torch.Generator().manual_seed(seed)
    state = OfficialPct().double().state_dict()
    for key, value in state.items():
        if not value.is_floating_point():
            continue
        u = torch.rand(value.shape, generator=g, dtype=value.dtype)
        if value.dim() >= 2:  # Conv1d (O, I, 1) and Linear (O, I): fan-in I
            value.copy_((u * 2 - 1) * (6 / value[0].numel()) ** 0.5)
        elif key.endswith(("running_var", ".weight")):  # BN scales and variances
            value.copy_(u + 0.5)
        else:  # biases, BN shifts and means
            value.copy_(u * 0.2 - 0.1)
    return {f"module.{k}": v for k, v in state.items()}


def test_released_key_layout():
    state = released_state()
    assert len(state) == 113 and state["module.pt_last.sa1.q_conv.weight"].shape == (64, 256, 1)
    assert state["module.pt_last.sa1.q_conv.weight"].data_ptr() == state["module.pt_last.sa1.k_conv.weight"].data_ptr()


def test_model_t7_loads_and_computes_the_official_function(tmp_path):
    path = tmp_path / "model.t7"
    state = released_state()
    torch.save(state, path)
    official = OfficialPct().double().eval()
    official.load_state_dict({k[len("module."):]: v for k, v in state.items()})
    ours = PCT(40, {"name": "offset"}).double().eval()
    assert load_weights(ours, str(path)) == "official"
    assert torch.equal(ours.blocks[2].mixer.qk.weight, state["module.pt_last.sa3.k_conv.weight"].squeeze(-1))
    assert torch.equal(ours.head[5].running_var, state["module.bn7.running_var"])
    g = torch.Generator().manual_seed(1)
    xyz = torch.rand(2, 1024, 3, generator=g, dtype=torch.float64) * 2 - 1
    xyz[:, 5] = 0.01  # within the kernel's skip radius
    with torch.no_grad():
        torch.testing.assert_close(ours(xyz), official(xyz.transpose(1, 2)), rtol=1e-9, atol=1e-9)


def test_training_step_is_the_official_one():
    """In training mode too: the batch statistics, the running statistics they update and every gradient are
    the official network's (the test above sees only the running statistics). The transliteration leaves out
    the head's dropout, so ours runs without it."""
    state = {k[len("module."):]: v for k, v in released_state().items()}
    official = OfficialPct().double().train()
    official.load_state_dict(state)
    ours = PCT(40, {"name": "offset"}, dropout=0.0).double().train()
    ours.load_state_dict(PCT.from_official(state))
    g = torch.Generator().manual_seed(2)
    xyz = torch.rand(2, 1024, 3, generator=g, dtype=torch.float64) * 2 - 1
    weights = torch.randn(2, 40, generator=g, dtype=torch.float64)
    assert_same_training_step(ours, official, ours(xyz), official(xyz.transpose(1, 2)), weights)


def assert_same_training_step(ours: nn.Module, official: nn.Module, logits, expected, weights) -> None:
    """Equal logits, then after one backward of sum(logits * weights) every gradient, and the running statistics
    the forward updated, mapped by ``type(ours).from_official`` (q_conv's gradient: the tied q/k weight's)."""
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    (logits * weights).sum().backward()
    (expected * weights).sum().backward()
    grads = type(ours).from_official({k: p.grad for k, p in official.named_parameters()})
    top = max(v.abs().max() for v in grads.values())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-9, atol=1e-9 * top, msg=name)
    buffers = type(ours).from_official(official.state_dict())
    for name, b in ours.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=1e-12, atol=1e-12, msg=name)


# --- through run.py: mode=test with the published weights, and files that do not fit ---------------------------
from test_run import TINY, env, run, user_error  # noqa: E402,F401 - env is a fixture
from fixture_cache import user_error_in_process  # noqa: E402

OFFICIAL_TINY = [*TINY, "attn=offset", "logger=none", "data.test_per_class=3"]  # demo's shapes: 10 classes


def test_mode_test_evaluates_the_published_model(env, tmp_path):
    import json

    from hydra import compose, initialize_config_dir

    from suite.compose import build_datamodule
    from test_run import ROOT

    path = tmp_path / "model.t7"
    official = OfficialPct(classes=10).double()
    state = released_state(3)
    official.load_state_dict({k[len("module."):]: v for k, v in state.items()
                              if not k.startswith("module.linear3.")}, strict=False)
    torch.save({f"module.{k}": v.float() for k, v in official.state_dict().items()}, path)
    out = tmp_path / "run"
    run([*OFFICIAL_TINY, "mode=test", f"model.weights={path}", f"hydra.run.dir={out}"], env)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["protocol"]["checkpoint"] == "weights model.t7"

    # The same test split through the official network, in this process: the same accuracy.
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        cfg = compose("config", [o for o in OFFICIAL_TINY if not o.startswith("logger")])
    data = build_datamodule(cfg, "test")
    model = PCT(10, {"name": "offset"}, samples=[64, 32], neighbours=16).eval()
    load_weights(model, str(path))
    right = total = 0
    with torch.no_grad():
        for batch in data.test_dataloader():
            right += int((model(batch["points"]).argmax(-1) == batch["label"]).sum())
            total += len(batch["label"])
    assert total == 30 and metrics["test/oa"] == pytest.approx(right / total, abs=1e-6)


def test_weights_that_do_not_fit_are_named(env, tmp_path, capsys):
    wrong = tmp_path / "wrong.pth"
    torch.save({"model": {"encoder.weight": torch.zeros(3, 3)}, "epoch": 3}, wrong)
    err = user_error_in_process([*OFFICIAL_TINY, "mode=test", f"model.weights={wrong}"], capsys, env["HOME"],
                                tmp_path / "wrong", f"model.weights={wrong} does not fit a PCT", "missing 109",
                                "unexpected 1 (encoder.weight)",
                                "a dict with keys ['model', 'epoch'] whose 'model' is a state dict of 1 tensors")
    assert "PCT_Pytorch's model.t7" in err
    text = tmp_path / "notes.txt"
    text.write_text("not weights")
    user_error_in_process([*OFFICIAL_TINY, "mode=test", f"model.weights={text}"], capsys, env["HOME"],
                          tmp_path / "text", f"model.weights={text} is not a PyTorch file")
    user_error_in_process([*OFFICIAL_TINY, "mode=test", f"model.weights={tmp_path / 'none.t7'}"], capsys,
                          env["HOME"], tmp_path / "none", "is not a file")
