"""PCT structure, loss and error behaviour."""

import pytest
import torch
import torch.nn.functional as F

import attention
from op_log import OpLog
from tasks.modelnet import reference_smoothing
from tasks.nets.pct import PCT, PCTPartSeg


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
    # the second stage samples among the first stage's centres: an FPS error or a kNN traceback before
    for samples, neighbours in (([32, 64], 8), ([32, 16], 40), ([32, 16], 0)):
        with pytest.raises(attention.UserError, match=r"model.samples\[1\] <= model.samples\[0\] and 1 <= "):
            PCT(5, {"name": "offset"}, samples=samples, neighbours=neighbours)


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


# --- the token-major layers: equal, in float64, to the channel-first modules whose parameters they hold ----------

@pytest.mark.parametrize("act", [torch.nn.ReLU(), torch.nn.LeakyReLU(0.2)], ids=["relu", "leaky"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_conv_bn_on_rows_is_conv1d_batchnorm1d(act, momentum):
    """ConvBN on (B, N, C) rows computes Conv1d + BatchNorm1d + act on (B, C, N): outputs, gradients and the
    running statistics (unbiased variance, momentum or cumulative average, batches counted) over two training
    steps, then eval mode, where the batch norm is folded into the linear layer."""
    from tasks.nets.pct import ConvBN

    torch.manual_seed(0)
    ours = ConvBN(5, 7, act).double()
    ours[1].momentum = momentum
    with torch.no_grad():
        ours[1].weight.uniform_(-1.5, 1.5)  # negative scales too
        ours[1].bias.uniform_(-0.5, 0.5)
    ref = torch.nn.Sequential(torch.nn.Conv1d(5, 7, 1, bias=False), torch.nn.BatchNorm1d(7, momentum=momentum),
                              act).double()
    ref.load_state_dict(ours.state_dict())
    for _ in range(2):
        x = torch.randn(3, 11, 5, dtype=torch.float64, requires_grad=True)
        g = torch.randn(3, 11, 7, dtype=torch.float64)
        y = ours(x)
        x_ref = x.detach().transpose(1, 2).requires_grad_()  # (B, C, N)
        y_ref = ref(x_ref).transpose(1, 2)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        y.backward(g)
        y_ref.backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad.transpose(1, 2), rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    for (name, b), c in zip(ours.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-14, atol=1e-14, msg=name)
    assert int(ours[1].num_batches_tracked) == 2
    x = torch.randn(3, 11, 5, dtype=torch.float64)
    torch.testing.assert_close(ours.eval()(x), ref.eval()(x.transpose(1, 2)).transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_place", [False, True])  # the CPU's default, and CUDA's (GROUP_ROWS_IN_PLACE)
def test_grouping_first_layer_is_the_concatenated_form(monkeypatch, in_place):
    """SampleAndGroup's first layer, W_d g + (W_c - W_d) c as one product on every point ([W_d; W_c - W_d]) and
    a gather, is the conv of the concatenated [g - c, c] rows (PCT's Local_op), before and after batch norm, in
    training and in eval (its batch norm folded in: the centres' rows take the shift): the values, the gradients
    of the features and of every parameter, and the running statistics, float64."""
    from attention.pointops import farthest_point_sample, gather, knn
    from tasks.nets import pct
    from tasks.nets.pct import SampleAndGroup

    monkeypatch.setattr(pct, "GROUP_ROWS_IN_PLACE", in_place)
    torch.manual_seed(0)
    group = SampleAndGroup(4, 6, samples=8, neighbours=5, fps="plain").double()
    ref = torch.nn.Sequential(*[torch.nn.Sequential(*layer) for layer in group.mlp]).double()
    ref.load_state_dict(group.mlp.state_dict())
    xyz = torch.rand(2, 20, 3, dtype=torch.float64)
    feats = torch.randn(2, 20, 4, dtype=torch.float64, requires_grad=True)
    seed = torch.randn(2, 8, 6, dtype=torch.float64)
    for mode in (True, False):
        group.train(mode), ref.train(mode)
        new_xyz, out = group(xyz, feats)
        centres = farthest_point_sample(xyz, 8)
        grouped = gather(feats, knn(gather(xyz, centres), xyz, 5))  # (B, S, K, C)
        centre = gather(feats, centres).unsqueeze(2).expand_as(grouped)
        x = torch.cat([grouped - centre, centre], dim=-1).reshape(16, 5, 8).transpose(1, 2)  # (B S, 2C, K)
        expected = ref(x).amax(-1).reshape(2, 8, 6)
        torch.testing.assert_close(new_xyz, gather(xyz, centres))
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        ours = torch.autograd.grad(out, [feats, *group.parameters()], seed)
        theirs = torch.autograd.grad(expected, [feats, *ref.parameters()], seed)
        for got, want in zip(ours, theirs, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for got, want in zip(group.mlp.state_dict().values(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # the running statistics


def _small(network):
    torch.manual_seed(0)
    if network == "PCT":
        return PCT(10, {"name": "offset"}, samples=[32, 16], neighbours=8), (torch.rand(4, 64, 3),)
    return PCTPartSeg(6, 3, {"name": "offset"}), (torch.rand(2, 48, 3), torch.tensor([0, 2]))


@pytest.mark.parametrize("network", ["PCT", "PCTPartSeg"])
def test_inference_keeps_its_folding_until_a_parameter_changes(network):
    """An evaluation over many batches folds the batch norms once (tasks.nets.pct.Folded): the second eval forward
    runs no folding op and gives the first one's bits; an optimizer step (in place: the versions move) or a training
    forward (the running statistics) makes the next eval forward fold again, with the new values: its logits are
    those of a network built from the new state dict. Under bf16 autocast the folded weights are cast once, and the
    logits are bit for bit those of the layer-by-layer folding that F.linear casts at every call."""
    import tasks.nets.pct as pct

    net, inputs = _small(network)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):  # running statistics away from their initial 0 and 1
        net(*inputs)
    net.eval()
    with torch.no_grad():
        first = net(*inputs)
        with OpLog() as ops:
            second = net(*inputs)
    assert torch.equal(first, second)
    assert ops.count["_foreach_rsqrt_"] == 0 and ops.count["rsqrt"] == 0, ops.count

    def check_refolds(tag):
        with torch.no_grad(), OpLog() as ops:
            got = net(*inputs)
        fresh, _ = _small(network)
        fresh.load_state_dict(net.state_dict())
        fresh.eval()
        with torch.no_grad():
            assert torch.equal(got, fresh(*inputs)), tag
        assert ops.count["_foreach_rsqrt_"] == 1, (tag, ops.count)

    net.train()
    net(*inputs)[0].sum().backward()  # a training forward moves the running statistics; then a step
    net.eval()
    check_refolds("after a training forward")
    opt.step()
    check_refolds("after an optimizer step (still in eval mode)")
    assert "_folded" not in net.train().__dict__  # training mode drops it (a write through .data has no version)
    net.eval()

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cast_first = net(*inputs)
        with OpLog() as ops:
            cast_second = net(*inputs)
        pct.FOLD_AT_ONCE = False
        try:
            with OpLog() as layerwise_ops:
                layerwise = net(*inputs)
        finally:
            pct.FOLD_AT_ONCE = True
    assert cast_first.dtype == torch.bfloat16 and torch.equal(cast_first, cast_second)
    assert torch.equal(cast_second, layerwise)
    # no cast of a folded weight or shift at the second forward (but PCT's two grouping layers: they subtract in
    # float32 first, as before; part segmentation's head conv cast its weight as two slices); the casts left are
    # activations' (the offset kernel's float32) and those layers'
    cast = 2 * len(net.fold_pairs()) + (-4 if network == "PCT" else 1)
    assert ops.count["_to_copy"] == layerwise_ops.count["_to_copy"] - cast, (ops.count, layerwise_ops.count)

    # a network made under torch.inference_mode has parameters without version counters: it folds at every forward
    with torch.inference_mode():
        made_there, _ = _small(network)
        made_there.load_state_dict(net.state_dict())
        made_there.eval()
        assert torch.equal(made_there(*inputs), net(*inputs)) and "_folded" not in made_there.__dict__


@pytest.mark.parametrize("network", ["PCT", "PCTPartSeg"])
def test_inference_folds_every_batch_norm_at_once_with_the_same_bits(network):
    """Eval mode without gradient (validation, test, the bench's eval step): every batch norm is folded into its conv
    by a few foreach calls over all layers (tasks.nets.pct.fold_all), not about seven ops a layer, whose launches
    bound PCT's inference forward on a GPU. The logits are those of the layer-by-layer folding, bit for bit (the
    same operations on each layer), in float32 and float64; nothing of it outlives the forward."""
    import tasks.nets.pct as pct

    for dtype in (torch.float32, torch.float64):
        net, inputs = _small(network)
        net, inputs = net.to(dtype), tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
        for _ in range(2):  # running statistics away from their initial 0 and 1
            net(*inputs)
        net.eval()
        # every conv followed by a batch norm, each once (part segmentation's last conv has none)
        convs = [m for m in net.modules() if type(m) is torch.nn.Conv1d and m is not net.head[-1]]
        assert sorted(map(id, convs)) == sorted(id(c) for c, _ in net.fold_pairs())
        assert len(convs) == (13 if network == "PCT" else 10)
        with torch.no_grad(), OpLog() as ops:
            folded_at_once = net(*inputs)
        by_layer = net(*inputs)  # gradient on: each layer folds its own (the folded weights carry the gradient)
        assert by_layer.requires_grad and torch.equal(folded_at_once, by_layer.detach()), dtype
        assert ops.count["rsqrt"] == 0 and ops.count["_foreach_rsqrt_"] == 1, ops.count
        assert pct._FOLDED.get() is None
        # FOLD_AT_ONCE=False (the bench's other form): layer by layer without gradient, the same bits
        pct.FOLD_AT_ONCE = False
        try:
            with torch.no_grad(), OpLog() as layerwise_ops:
                layerwise = net(*inputs)
        finally:
            pct.FOLD_AT_ONCE = True
        assert torch.equal(folded_at_once, layerwise), dtype
        assert layerwise_ops.count["_foreach_rsqrt_"] == len(convs), layerwise_ops.count  # fold_all of one pair


def test_training_with_or_without_norm_act_max_is_the_same_function(monkeypatch):
    """PCT's grouping and fuse layers in training: NormActMax (batch norm, activation and max without the normalised
    (B, S, K, C) tensor) and the plain batch norm + activation + max (tasks.nets.pct.FUSED_NORM_ACT_MAX = False,
    which benchmarks.pct_cuda times beside it) give the same logits, gradients and running statistics in float64;
    the plain form dispatches fewer ops (10 a layer against about 24), NormActMax moves fewer bytes. By default
    (None) the CPU takes NormActMax: the same ops as True."""
    import tasks.nets.pct as pct

    from benchmarks.measure import OpCounter

    runs = {}
    for fused in (True, False, None):
        monkeypatch.setattr(pct, "FUSED_NORM_ACT_MAX", fused)
        warm, (xyz,) = _small("PCT")
        warm.double()(xyz.double())  # uncounted: a process's first call fills caches (2 more kernels, run alone)
        net, (xyz,) = _small("PCT")
        net = net.double()
        with OpCounter() as ops:
            logits = net(xyz.double())
            logits.square().sum().backward()
        bn = net.groups[0].mlp[1][1]
        runs[fused] = (logits.detach(), [p.grad for p in net.parameters()], bn.running_mean, bn.running_var, ops)
    (a, grads_a, mean_a, var_a, ops_a), (b, grads_b, mean_b, var_b, ops_b) = runs[True], runs[False]
    assert runs[None][4].kernels == ops_a.kernels and torch.equal(runs[None][0], a)  # the CPU's default: NormActMax
    monkeypatch.setattr(pct, "FUSED_NORM_ACT_MAX", None)  # a GPU's default: the plain form (launch-bound steps)
    assert [pct.takes_norm_act_max(torch.device(d)) for d in ("cpu", "cuda", "mps")] == [True, False, False]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # against the whole gradient's norm: single entries near 0 cancel differently (1e-12 apart at 1e-3), and a bias
    # before a batch norm has a gradient of 0 in exact arithmetic, rounding noise in both forms
    scale = torch.stack([g.norm() for g in grads_b]).norm()
    for ga, gb in zip(grads_a, grads_b):
        assert ((ga - gb).norm() / scale).item() < 1e-12
    torch.testing.assert_close(mean_a, mean_b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(var_a, var_b, rtol=1e-12, atol=1e-14)
    assert ops_b.kernels < ops_a.kernels and ops_a.bytes_moved < ops_b.bytes_moved, (ops_a.kernels, ops_b.kernels)


@pytest.mark.parametrize("act", [torch.nn.ReLU(), torch.nn.LeakyReLU(0.2)])
def test_norm_act_max_with_weights_of_both_signs_is_the_plain_form(monkeypatch, act):
    """A batch norm weight below 0 turns the max over K after it into the min before it: NormActMax takes the max
    of the sign-flipped rows (one reduction with indices, not a max and a min). With weights of both signs and tied
    rows (a point grouped twice: the same features), its output, every gradient and the running statistics are the
    plain batch norm + activation + max's in float64; with every weight > 0 (the CPU's shortcut: one max) too. (At a
    weight of exactly 0 every row ties after the batch norm: the plain form's max takes the first, NormActMax the
    row of the largest h, the one-sided derivative's; both are subgradients of the max.)"""
    import tasks.nets.pct as pct

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5, 4, dtype=torch.float64, generator=gen)  # (P, K, I)
    x[:, 3] = x[:, 1]  # ties: K rows 1 and 3 equal in every sample
    grad = torch.randn(6, 7, dtype=torch.float64, generator=gen)
    bias = torch.randn(7, dtype=torch.float64, generator=gen)
    for weight in (torch.tensor([1.5, -0.5, 0.3, -2.0, 0.7, 1.0, -1e-3]), torch.rand(7, generator=gen) + 0.1):
        results = []
        for fused in (True, False):
            monkeypatch.setattr(pct, "FUSED_NORM_ACT_MAX", fused)
            torch.manual_seed(0)
            layer = pct.ConvBNMax(4, 7, act).double()
            with torch.no_grad():
                layer[1].weight.copy_(weight)
                layer[1].bias.copy_(bias)
            inp = x.clone().requires_grad_()
            out = layer(inp)
            out.backward(grad)
            results.append((out.detach(), inp.grad, layer[0].weight.grad, layer[1].weight.grad, layer[1].bias.grad,
                            layer[1].running_mean, layer[1].running_var))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
def test_group_rows_on_cuda_adds_in_place_as_the_cpu_adds():
    """GroupRows on a CUDA GPU (its index-adds in place into the halves of one (R, 2C) gradient, the default
    there) against the CPU's float64: the grouped rows with the shift, and the gradients of the rows and of it."""
    from tasks.nets.pct import GroupRows, adds_in_place

    assert adds_in_place(torch.device("cuda")) and not adds_in_place(torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    both = torch.randn(64, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    idx, centre = torch.randint(0, 64, (2, 5, 7), generator=gen), torch.randint(0, 64, (2, 5), generator=gen)
    grad = torch.randn(2, 5, 7, 6, generator=gen, dtype=torch.float64)
    out = GroupRows.apply(both, idx, centre, bias)
    want = (out, *torch.autograd.grad(out, (both, bias), grad))
    cuda = [t.detach().float().cuda().requires_grad_() for t in (both, bias)]
    out = GroupRows.apply(cuda[0], idx.cuda(), centre.cuda(), cuda[1])
    got = (out, *torch.autograd.grad(out, cuda, grad.float().cuda()))
    for a, w in zip(got, want):
        torch.testing.assert_close(a.cpu().double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("network", ["PCT", "PCTPartSeg"])
def test_training_forward_counts_its_batch_norms_in_one_op(monkeypatch, network):
    """A training forward leaves every batch norm's num_batches_tracked += 1 to one foreach op at its end
    (counted_once; nn.BatchNorm1d adds in an op of its own, a launch each on a GPU): the counters, the running
    statistics, the logits and the gradients are those of the modules' own forwards, bit for bit, over two steps;
    and the forward dispatches one foreach op where the modules dispatched an add each."""
    import contextlib

    from op_log import OpLog
    from tasks.nets import pct

    def steps(counted: bool):
        net, inputs = _small(network)
        net.train()
        if not counted:
            monkeypatch.setattr(pct, "counted_once", lambda net: contextlib.nullcontext())
        results = []
        for _ in range(2):
            with OpLog() as log:
                out = net(*inputs)
            results += [out, *torch.autograd.grad(out.square().sum(), list(net.parameters()))]
        monkeypatch.undo()
        return results, [b.clone() for b in net.buffers()], log.count

    (fused, fused_buffers, fused_ops), (plain, plain_buffers, plain_ops) = steps(True), steps(False)
    for got, want in zip(fused + fused_buffers, plain + plain_buffers, strict=True):
        assert torch.equal(got, want)
    counted = {"PCT": 13, "PCTPartSeg": 10}[network]  # PCT's head runs its two batch norms as modules
    assert fused_ops["_foreach_add_"] == 1 and plain_ops["_foreach_add_"] == 0
    assert plain_ops["add_"] - fused_ops["add_"] == counted, (plain_ops["add_"], fused_ops["add_"])
    counters = [b for b in fused_buffers if b.dtype == torch.long]  # every num_batches_tracked, after two steps
    assert len(counters) == counted + (2 if network == "PCT" else 0) and all(b.item() == 2 for b in counters)


@pytest.mark.parametrize("network", ["PCT", "PCTPartSeg"])
@pytest.mark.parametrize("switch", ["BATCH_NORM_CHANNELS_LAST", "CONVOLUTIONS"])
def test_cudnn_forms_are_the_same_function(monkeypatch, network, switch):
    """The forms that reach cuDNN on a GPU: with BATCH_NORM_CHANNELS_LAST every plain batch norm of a training
    forward sees its rows as a (1, C, R, 1) channels-last view; with CONVOLUTIONS every 1x1 convolution
    (``linear_rows``) runs as ``F.conv2d`` on such a view, with a channels-last kernel. Over two float64 training
    steps and an eval forward (the batch norms folded), the logits, every parameter's gradient and the running
    statistics equal the default form's (to rounding: the kernels sum in another order). In the GPU's form of the
    grouping and fuse layers (plain batch norm + max, not NormActMax), where they would run."""
    from tasks.nets import pct

    monkeypatch.setattr(pct, "FUSED_NORM_ACT_MAX", False)
    seen, calls = [], []
    spied = "batch_norm" if switch == "BATCH_NORM_CHANNELS_LAST" else "conv2d"
    original, linear_rows = getattr(F, spied), pct.linear_rows

    def spy(x, *args, **kwargs):
        last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
        # the kernel channels-last too, but for a slice of a weight (part segmentation's per-point half), which
        # no view makes dense
        kernel = spied != "conv2d" or args[0].is_contiguous(memory_format=torch.channels_last) \
            or args[0].stride(0) != args[0].shape[1]
        seen.append(last and kernel)
        return original(x, *args, **kwargs)

    def counted(*args, **kwargs):
        calls.append(1)
        return linear_rows(*args, **kwargs)

    def steps(on: bool):
        monkeypatch.setattr(pct, switch, on)
        net, inputs = _small(network)
        net.double().train()
        inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
        results = []
        for _ in range(2):
            out = net(*inputs)
            results += [out, *torch.autograd.grad(out.square().sum(), list(net.parameters()))]
        net.eval()
        with torch.no_grad():
            results.append(net(*inputs))
        return results + [b.clone() for b in net.buffers()]

    monkeypatch.setattr(F, spied, spy)
    monkeypatch.setattr(pct, "linear_rows", counted)
    plain = steps(False)
    assert not any(seen)
    layers, before = len(calls), len(seen)
    views = steps(True)
    assert len(calls) == 2 * layers and sum(seen[before:]) > 0
    counted_norms = {"PCT": 13, "PCTPartSeg": 10}[network]  # PCT's head runs its two batch norms as modules, 2-D
    assert sum(seen) == (2 * counted_norms if spied == "batch_norm" else layers), (sum(seen), layers)
    for got, want in zip(views, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("switch", ["BATCH_NORM_CHANNELS_LAST", "CONVOLUTIONS"])
def test_cudnn_forms_reach_cudnn_on_cuda(monkeypatch, switch):
    """On a CUDA GPU the channels-last batch norms run cuDNN's kernels (13 a forward and a backward; the 2-D rows
    torch's native ones), and the convolution form cuDNN's convolutions (the default form none), and one float32
    training step of PCT gives the default form's logits and gradients to float32's rounding (cuDNN's TF32 off
    here: under torch's defaults its convolutions take TF32, the point of that form, and round to 1e-3)."""
    from tasks.nets import pct

    monkeypatch.setattr(pct, "FUSED_NORM_ACT_MAX", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pct, switch, on)
        net, (xyz,) = _small("PCT")
        net.cuda().train()
        with OpLog() as log, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = net(xyz.cuda())
            grads = torch.autograd.grad(out.square().sum(), list(net.parameters()))
        names = {e.name for e in prof.events()}
        results[on] = (out, grads, log.count, names)
    (out_a, grads_a, ops_a, names_a), (out_b, grads_b, ops_b, names_b) = results[False], results[True]
    if switch == "BATCH_NORM_CHANNELS_LAST":
        assert ops_b["cudnn_batch_norm"] == 13 and ops_b["cudnn_batch_norm_backward"] == 13, ops_b
        assert ops_a["cudnn_batch_norm"] == 0 and ops_a["native_batch_norm"] >= 13, ops_a
    else:
        assert "aten::cudnn_convolution" in names_b and "aten::cudnn_convolution" not in names_a
        assert ops_b["convolution"] == 13 and ops_a["convolution"] == 0, (ops_a, ops_b)
    torch.testing.assert_close(out_b, out_a, rtol=1e-4, atol=1e-5)
    scale = torch.stack([g.norm() for g in grads_a]).norm()
    for a, b in zip(grads_b, grads_a):
        assert ((a - b).norm() / scale).item() < 1e-4


def test_a_cosine_of_a_step_bounded_run_spans_the_runs_epochs():
    """``T_max: ${trainer.max_epochs}`` is -1 in a run bounded by trainer.max_steps alone: torch's cosine then swung
    the rate between lr and eta_min every epoch (0.01, 1e-4, 0.01, ...), exit 0. It spans the run's epochs now:
    27 steps of 9 a epoch (4 batches a step under accumulation 2: 5 steps) are 6 epochs."""
    from types import SimpleNamespace

    from attention.errors import UserError
    from tasks.modelnet import PointCloudClassification
    from tasks.optim import build_optimizers, run_epochs

    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01}
    cosine = {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True, "T_max": -1,
              "eta_min": 1e-4}
    trainer = SimpleNamespace(train_dataloader=[], estimated_stepping_batches=27, num_training_batches=9,
                              accumulate_grad_batches=2)
    assert run_epochs(trainer) == 6
    task = PointCloudClassification(4, list("abcd"), model={"samples": [8, 4], "neighbours": 2, "layers": 1},
                                    attn={"name": "offset"}, optim={"optimizer": sgd, "scheduler": cosine},
                                    input_points=16)
    task._trainer = trainer
    scheduler = task.configure_optimizers()["lr_scheduler"]["scheduler"]
    rates = [scheduler.get_last_lr()[0]]
    for _ in range(6):
        scheduler.optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    assert scheduler.T_max == 6 and rates == sorted(rates, reverse=True) and rates[-1] == pytest.approx(1e-4)
    given = build_optimizers([torch.nn.Parameter(torch.zeros(1))], {"optimizer": sgd, "scheduler": {**cosine,
                             "T_max": 250}}, trainer)
    assert given["lr_scheduler"]["scheduler"].T_max == 250  # a length given is kept
    endless = SimpleNamespace(**{**vars(trainer), "estimated_stepping_batches": float("inf")})
    with pytest.raises(UserError, match=r"optim\.scheduler\.T_max=-1"):
        build_optimizers([torch.nn.Parameter(torch.zeros(1))], {"optimizer": sgd, "scheduler": cosine}, endless)
