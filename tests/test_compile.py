"""``trainer.compile=true`` (suite/compile.py): the networks under torch.compile give the eager outputs and
gradients, compile a bounded number of graphs (a partial batch, evaluation and test do not recompile every step),
keep checkpoints interchangeable with uncompiled runs, and log what compiling cost.

Compiling costs seconds of CPU per graph even for a tiny network, so everything here uses SPCT (``embedding=point``,
no sampling or kNN) with one block on 32 points, and the tracing backends (``aot_eager``: dynamo + AOTAutograd, the
graphs and guards inductor gets, without code generation) except for one inductor forward.
"""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch

import attention
from suite.compile import compile_in_place, compiled_graphs, isolates_recompiles
from test_run import env, run  # noqa: F401 - env is a fixture

OPTIM = {"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01}}
SMALL = {"embedding": "point", "layers": 1, "samples": [16, 8], "neighbours": 8, "dropout": 0.5}
# 10 classes x 4 training shapes in batches of 16 (the last partial one is dropped for BatchNorm, as PCT does), 20
# validation and 20 test shapes in batches of 8: 8, 8 and a partial 4. Lightning's model summary stays on (it runs a
# one-sample forward at fit start, before the networks are compiled).
TINY = ["task=modelnet", "data=shapes", "attn=offset", "data.npoints=32", "model.embedding=point", "++model.layers=1",
        "model.samples=[16,8]", "model.neighbours=8", "data.train_per_class=4", "data.val_per_class=2",
        "data.test_per_class=2", "data.batch_size=16", "data.eval_batch_size=8", "trainer.enable_progress_bar=false"]
EPOCHS = 3


def tiny_task(classes: int = 4):
    from tasks.modelnet import PointCloudClassification

    torch.manual_seed(0)
    return PointCloudClassification(classes, [str(i) for i in range(classes)], model=SMALL, attn={"name": "offset"},
                                    optim=OPTIM, input_points=32)


def test_compiled_network_matches_eager_and_stops_recompiling(one_thread):
    """Through the task's own hook (``networks()``) and in place: outputs and gradients equal the eager network's
    (dropout too: aot_eager draws from torch's generator), over full and partial batches in training and evaluation;
    once each (mode, grad) has been seen with two batch sizes, no step compiles anything."""
    task = tiny_task()
    eager = copy.deepcopy(task.net)
    [(name, net)] = task.networks()
    assert net is task.net
    keys = list(net.state_dict())
    compile_in_place(net, backend="aot_eager")
    assert list(net.state_dict()) == keys  # in place: checkpoints keep their keys
    steps = [(True, 8), (True, 5), (False, 8), (False, 3)]  # (training, batch size): full and last partial batch

    def step(training: bool, size: int, seed: int) -> None:
        x = torch.randn(size, 32, 3, generator=torch.Generator().manual_seed(seed))
        outs = []
        for model in (net, eager):
            model.train(training)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            with torch.set_grad_enabled(training):
                out = model(x)
                if training:
                    out.square().sum().backward()
            outs.append((out.detach(), [p.grad for p in model.parameters()] if training else []))
        (out, grads), (ref, ref_grads) = outs
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads):  # eager trains the fuse layer through the fused max-over-batch-norm
            # (tasks/nets/pct.py NormActMax), compiled code through the plain form: equal but for float32 rounding
            torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)

    before = compiled_graphs()
    for seed, (training, size) in enumerate(steps):
        step(training, size, seed)
    first = compiled_graphs() - before
    assert 0 < first <= len(steps)
    for seed, (training, size) in enumerate(steps * 2 + [(True, 6), (False, 5)], start=10):  # new sizes too
        step(training, size, seed)
    assert compiled_graphs() - before == first  # nothing compiled after the first pass
    for p, r in zip(net.parameters(), eager.parameters()):  # BatchNorm statistics moved alike
        torch.testing.assert_close(p, r)
    for b, r in zip(net.buffers(), eager.buffers()):
        torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6)


def test_the_gan_compiles_both_of_its_networks():
    """A task with two networks (manual optimisation) names both; each is compiled in place, state keys unchanged."""
    from tasks.gan import GAN

    gan = GAN(num_classes=2, class_names=["a", "b"], resolution=32, attn={"name": "self"}, optim={},
              model={"z_dim": 16, "g_channels": 16, "d_channels": 16})
    assert gan.networks() == [("G", gan.G), ("D", gan.D)]
    keys = list(gan.state_dict())
    for _, net in gan.networks():
        compile_in_place(net, backend="aot_eager", networks=2)
    assert list(gan.state_dict()) == keys


def test_a_torch_without_isolated_recompiles_gets_the_same_budget(monkeypatch, one_thread):
    """torch 2.11 (the declared floor) has no ``isolate_recompiles``/``recompile_limit`` in ``torch.compile``: there the
    GAN's two networks share dynamo's process-wide limit, raised to RECOMPILE_LIMIT for each of them (never lowered),
    and the compiled networks give the eager outputs. Where torch has the arguments, the global limit is untouched."""
    import torch._dynamo.config as dynamo_config

    import suite.compile as compile_module
    from tasks.gan import GAN

    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)
    if isolates_recompiles():  # the lock's torch: each network's own budget, the process-wide limit as it was
        compile_in_place(tiny_task().net, backend="aot_eager")
        assert dynamo_config.recompile_limit == 8
    monkeypatch.setattr(compile_module, "isolates_recompiles", lambda: False)  # as on torch 2.11
    torch.manual_seed(0)
    gan = GAN(num_classes=2, class_names=["a", "b"], resolution=32, attn={"name": "external"}, optim={},
              model={"z_dim": 16, "g_channels": 16, "d_channels": 16}).eval()
    z, y = torch.randn(3, 16), torch.tensor([0, 1, 1])
    with torch.no_grad():
        expected = gan.D(gan.G(z, y), y)
        for _, net in gan.networks():
            compile_in_place(net, backend="aot_eager", networks=2)
        assert dynamo_config.recompile_limit == 2 * compile_module.RECOMPILE_LIMIT
        torch.testing.assert_close(gan.D(gan.G(z, y), y), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(dynamo_config, "recompile_limit", 1000)
    compile_in_place(tiny_task().net, backend="aot_eager", networks=2)
    assert dynamo_config.recompile_limit == 1000  # raised, never lowered


def test_inductor_forward_matches_eager(one_thread):
    """The one inductor test (it generates and compiles C++; tens of seconds of CPU for any graph): the evaluation
    forward of the generated code equals the eager one to float32 tolerance."""
    task = tiny_task().eval()
    eager = copy.deepcopy(task.net)
    compile_in_place(task.net, backend="inductor")
    x = torch.randn(4, 32, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(task.net(x), eager(x), rtol=1e-4, atol=1e-5)


def test_the_gans_training_steps_run_under_inductor(one_thread):
    """The GAN's discriminator step calls D twice (real, then generated images), and each call's spectral-norm power
    iteration updates D's u and v in place. With one backward after both calls, inductor's graph of the first call
    had saved u and v, and the backward failed ("modified by an inplace operation", torch 2.11 and 2.14, CPU and
    H200; aot_eager and aot_eager_decomp_partition do not show it). The task backs up each call's term before the
    next call.

    The smallest D that showed it (no attention block, unconditional: the residual blocks' spectral norms) and
    inductor's scalar C++ (``cpp.vec_isa_ok=False``): a fresh machine compiles each kernel with g++, and the full D's
    vectorised kernels took 81 s of this test's 100 on one, this D's scalar ones 33 s; with the task's one backward
    of the sum put back, this form fails as the full one did."""
    import lightning as L
    import torch._inductor.config as inductor_config

    from task_steps import TASKS, build

    datamodule, module = build([*TASKS["gan"], "model.g_channels=8", "model.d_channels=8", "model.z_dim=8",
                                "model.d_attn_block=null", "model.conditional=false"])
    compile_in_place(module.D, backend="inductor")  # the network that failed (G is called once per backward)
    before = [p.detach().clone() for p in module.D.parameters()]
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False, accelerator="cpu",
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1
    assert any(not torch.equal(a, p) for a, p in zip(before, module.D.parameters()))  # D was updated
    assert all(p.isfinite().all() for p in module.parameters())


# --- python run.py trainer.compile=true ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_run(env, tmp_path_factory):  # noqa: F811 - env is a fixture
    out = tmp_path_factory.mktemp("compiled")
    run([*TINY, f"trainer.max_epochs={EPOCHS}", "trainer.compile=true", "trainer.compile_backend=aot_eager",
         "logger=csv", f"hydra.run.dir={out}"], env)
    return out


def logged(out, key: str) -> list[float]:
    with (out / "csv" / "metrics.csv").open() as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def test_compiled_run_logs_compile_time_and_stops_recompiling(compiled_run):
    """Graphs are compiled in the first epoch (sanity check, validation with its partial batch, training) and never
    again while training; the test stage (inference mode, its own partial batch) adds at most as many again, not one
    per batch. The cost is in the CSV log after every epoch and in metrics.json."""
    graphs, seconds = logged(compiled_run, "train/compile_graphs"), logged(compiled_run, "train/compile_seconds")
    assert len(graphs) == len(seconds) == EPOCHS
    assert graphs[0] >= 2 and graphs == [graphs[0]] * EPOCHS  # validation's partial batch compiled once, then none
    assert seconds[0] > 0 and seconds == [seconds[0]] * EPOCHS
    metrics = json.loads((compiled_run / "metrics.json").read_text())
    assert graphs[0] <= metrics["compile_graphs"] <= 2 * graphs[0]
    assert metrics["compile_time_s"] >= seconds[0]
    assert 0 <= metrics["test/oa"] <= 1 and metrics["flops"] > 0 and metrics["train_samples_per_sec"] > 0


def test_compiled_checkpoint_is_an_uncompiled_one(compiled_run, env, tmp_path):  # noqa: F811 - env is a fixture
    """A compiled run's checkpoint has the uncompiled network's keys (no ``_orig_mod.``), so it loads into an
    uncompiled network and an uncompiled network's state loads into a compiled one; tested without compiling, it
    gives the compiled run's test metrics."""
    metrics = json.loads((compiled_run / "metrics.json").read_text())
    [best] = (compiled_run / "checkpoints").glob("best-*.ckpt")
    state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    net = {k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")}
    task = tiny_task(classes=10)  # data=shapes' classes
    fresh = copy.deepcopy(task.net)
    task.net.compile(backend="aot_eager")
    for target in (fresh, task.net):  # uncompiled <- compiled run's weights; compiled <- uncompiled state
        assert list(target.state_dict()) == list(net)
    fresh.load_state_dict(net)
    task.net.load_state_dict(fresh.state_dict())

    run([*TINY, "mode=test", f"ckpt_path={best}", "logger=none", f"hydra.run.dir={tmp_path}"], env)
    eager = json.loads((tmp_path / "metrics.json").read_text())
    assert "compile_time_s" not in eager
    for key in ("test/oa", "test/macc", "test/loss"):
        assert eager[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("embedding, attn", [("neighbor", "offset"), ("point", "offset"), ("neighbor", "focal"),
                                             ("neighbor", "dilated")])
def test_pct_compiles_as_one_graph(one_thread, embedding, attn):
    """PCT's sampling and grouping are one library op, and so are FPS and kNN that focal and dilated attention run
    on point sets (attention/pointops.py): leaves of dynamo's graph, so the whole network is one graph in training and
    in evaluation, with no break (a break inside its loop over the groupings or blocks made dynamo run PCT.forward
    eagerly and compile only the pieces, 7 to 10 graphs: CUDA graphs could not take it whole)."""
    from tasks.nets.pct import PCT

    torch.manual_seed(0)
    net = PCT(4, {"name": attn}, samples=[16, 8], neighbours=4, embedding=embedding)
    x = torch.randn(4, 32, 3)
    for training in (True, False):
        net.train(training)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(net)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (training, explained.break_reasons)


def test_the_neighbourhood_ops_fake_kernel_has_the_real_kernels_shapes():
    """attention_suite::pct_neighbourhoods: its fake kernel (what torch.compile traces) gives the real kernel's shapes
    and dtypes, and the op gives attention.pointops' own FPS centres and kNN groups."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attention.pointops import farthest_point_sample, gather, knn
    from tasks.nets.pct import neighbourhoods

    xyz = torch.rand(3, 40, 3, generator=torch.Generator().manual_seed(0))
    centres, new_xyz, groups = neighbourhoods(xyz, 10, 5, True)
    want = farthest_point_sample(xyz, 10, like_kernel=True)
    assert torch.equal(centres, want) and torch.equal(new_xyz, gather(xyz, want))
    assert torch.equal(groups, knn(gather(xyz, want), xyz, 5))
    with FakeTensorMode() as mode:
        fake = torch.ops.attention_suite.pct_neighbourhoods(mode.from_tensor(xyz), 10, 5, True)
    real = torch.ops.attention_suite.pct_neighbourhoods(xyz, 10, 5, True)
    assert [(t.shape, t.stride(), t.dtype) for t in fake] == [(t.shape, t.stride(), t.dtype) for t in real]
    # torch's own checks of a custom op: schema, fake kernel (strides too: inductor asserts them), autograd, AOT
    torch.library.opcheck(torch.ops.attention_suite.pct_neighbourhoods.default, (xyz, 10, 5, True))
    torch.library.opcheck(torch.ops.attention_suite.pct_neighbourhoods.default, (xyz, 10, 5, False))


def test_a_gradient_still_reaches_the_points_through_the_neighbourhood_op():
    """The op returns indices only; the centres' coordinates are gathered outside it, so attacks and saliency maps on
    the input points (a gradient with respect to them) keep working, with no autograd warning."""
    import warnings

    from tasks.nets.pct import PCT

    torch.manual_seed(0)
    net = PCT(4, {"name": "offset"}, samples=[16, 8], neighbours=4)
    x = torch.randn(4, 32, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("args", [
    lambda xyz: (xyz, 10, None, 0, True, "auto"),           # pointnet2_ops' picks
    lambda xyz: (xyz, 10, None, 3, False, "torch"),         # one start for every sample
    lambda xyz: (xyz, 10, torch.tensor([5, 0, 39]), 0, False, "auto"),  # a start per sample
])
def test_fps_op_passes_torchs_custom_op_checks(args):
    """attention_suite::farthest_point_sample: schema, fake kernel (shape, dtype, strides: inductor asserts them),
    autograd registration and AOT dispatch, as torch.library.opcheck tests them; the op is what the function returns."""
    from attention.pointops import farthest_point_sample

    xyz = torch.rand(3, 40, 3, generator=torch.Generator().manual_seed(1))
    a = args(xyz)
    torch.library.opcheck(torch.ops.attention_suite.farthest_point_sample.default, a)
    start = a[2] if a[2] is not None else a[3]
    want = farthest_point_sample(xyz, 10, start, like_kernel=a[4], backend=a[5])
    assert torch.equal(torch.ops.attention_suite.farthest_point_sample(*a), want) and want.is_contiguous()


@pytest.mark.parametrize("m, n, k", [(7, 40, 5), (40, 40, 40)])
def test_knn_op_passes_torchs_custom_op_checks(m, n, k):
    from attention.pointops import knn

    g = torch.Generator().manual_seed(2)
    query, points = torch.rand(2, m, 3, generator=g), torch.rand(2, n, 3, generator=g)
    torch.library.opcheck(torch.ops.attention_suite.knn.default, (query, points, k))
    assert torch.equal(torch.ops.attention_suite.knn(query, points, k), knn(query, points, k))


@pytest.mark.parametrize("name", [n for n in attention.names()
                                  if "grid" in attention.get(n).layouts])
def test_every_variant_on_a_grid_compiles_as_one_graph(one_thread, name):
    """The image backbones' mixers (classification, segmentation, the GAN): no graph break in training or
    evaluation. Focal attention's window plan once held a boolean mask's data-dependent shape, a break in every block
    of a focal backbone: 47 graphs for Focal-T, each stage recompiled, minutes of compiling on a GPU machine."""
    torch.manual_seed(0)
    mixer = attention.build(name, dim=32)
    x = torch.randn(2, 9 * 10, 32)
    for training in (True, False):
        mixer.train(training)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(mixer)(x, attention.Grid(9, 10))
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (training, explained.break_reasons)
