"""PCT structure, loss and error behaviour."""

import pytest
import torch
import torch.nn.functional as F

import attention
from tasks.modelnet import reference_smoothing
from tasks.nets.pct import PCT


def trainable(m):
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


def test_published_parameter_count():
    assert trainable(PCT(40, {"name": "offset"})) == 2_876_136


def test_every_variant_plugs_in_and_trains():
    xyz = torch.rand(2, 128, 3)
    for name in attention.names():
        net = PCT(5, {"name": name}, samples=[32, 16], neighbours=8)
        logits = net(xyz)
        assert logits.shape == (2, 5) and torch.isfinite(logits).all()
        logits.sum().backward()
        # Grid-only parameters (e.g. focal's relative position biases) get no gradient on point sets.
        grads = {n: p.grad for n, p in net.blocks[0].mixer.named_parameters() if p.grad is not None}
        assert grads and all(torch.isfinite(g).all() for g in grads.values()), name
        assert net.embed[0][0].weight.grad is not None and net.head[-1].weight.grad.abs().sum() > 0


def test_spct_point_embedding_has_no_grouping():
    net = PCT(5, {"name": "offset"}, embedding="point").eval()
    assert len(net.groups) == 0 and net.blocks[0].mixer.dim == 128
    assert net(torch.rand(2, 64, 3)).shape == (2, 5)


def test_prediction_is_invariant_to_point_order():
    torch.manual_seed(0)
    net = PCT(4, {"name": "external"}, samples=[32, 16], neighbours=8).eval()
    xyz = torch.rand(2, 96, 3)
    perm = torch.randperm(96)
    # FPS starts from point 0; keep it first so both orders sample the same centres.
    perm = torch.cat([torch.tensor([0]), perm[perm != 0]])
    torch.testing.assert_close(net(xyz), net(xyz[:, perm]), rtol=1e-4, atol=1e-5)


def test_too_few_points_is_a_user_error():
    net = PCT(5, {"name": "offset"}, samples=[64, 32], neighbours=16)
    with pytest.raises(attention.UserError, match="data.npoints"):
        net(torch.rand(1, 40, 3))


def test_bad_model_options_name_the_option():
    with pytest.raises(attention.UserError, match="model.embedding"):
        PCT(5, {"name": "offset"}, embedding="graph")
    with pytest.raises(attention.UserError, match="attn.heads"):
        PCT(5, {"name": "self", "heads": 3})


def test_label_smoothing_matches_reference_cal_loss():
    # PCT's cal_loss: one_hot * (1 - eps) + (1 - one_hot) * eps / (K - 1), then -sum(log_softmax * target).
    torch.manual_seed(0)
    k, eps = 7, 0.2
    logits = torch.randn(5, k, dtype=torch.float64)
    label = torch.tensor([0, 3, 6, 2, 2])
    target = torch.full((5, k), eps / (k - 1), dtype=torch.float64)
    target[torch.arange(5), label] = 1 - eps
    reference = -(F.log_softmax(logits, dim=1) * target).sum(1).mean()
    ours = F.cross_entropy(logits, label, label_smoothing=reference_smoothing(eps, k))
    torch.testing.assert_close(ours, reference)


def test_partseg_published_parameter_count_and_shapes():
    from tasks.nets.pct import PCTPartSeg

    net = PCTPartSeg(50, 16, {"name": "offset"})
    assert trainable(net) == 2_446_130
    logits = net.eval()(torch.rand(2, 64, 3), torch.tensor([0, 15]))
    assert logits.shape == (2, 50, 64)


def test_partseg_category_changes_the_prediction_and_normals_widen_the_input():
    from tasks.nets.pct import PCTPartSeg

    torch.manual_seed(0)
    net = PCTPartSeg(6, 3, {"name": "external"}, in_channels=6).eval()
    x = torch.rand(1, 32, 6)
    a, b = net(x, torch.tensor([0])), net(x, torch.tensor([2]))
    assert not torch.allclose(a, b)  # the category one-hot feeds every point
    torch.testing.assert_close(net(x[:, torch.arange(31, -1, -1)], torch.tensor([0])), a.flip(-1),
                               rtol=1e-4, atol=1e-5)  # per-point outputs follow the points
