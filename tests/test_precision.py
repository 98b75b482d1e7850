"""Mixed precision (`trainer.precision=bf16-mixed` and `16-mixed`): kernels normalise in float32, every task trains;
and every task trains at `bf16-true` and `64-true` (the whole network in that dtype), its metrics kept in theirs.

- Kernels: inputs that half precision cannot normalise (eps = 1e-9 is 0 in float16, exp and sums over many tokens
  overflow float16's 65504, bfloat16's 8-bit mantissa ruins unscaled logits) give the float64 answer under autocast.
  Each case gave NaN or inf (float16), or a 19% error (bfloat16), before the kernels computed in float32.
- Mixers: every registered variant on every layout it serves, forward and backward under bfloat16 and float16
  autocast, is finite and close to float32.
- Tasks: `run.py` at 32-true, bf16-mixed, 16-mixed, bf16-true and 64-true for each task (one process, Hydra
  multiruns), finite metrics close to float32's (every task crashed at the start of fit at `*-true` before); and the GAN's manual optimisation goes through the GradScaler once per optimizer step.

Lightning turns `16-mixed` on a CPU into `bf16-mixed` (with a warning): the task runs below patch that choice, so
that on CPU, as on a GPU, `16-mixed` is float16 autocast with a GradScaler.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from fixture_cache import once_per_worker
from test_run import GAN_TINY, ROOT, SEG_TINY, TINY, env  # noqa: F401 - env is a fixture

import attention
from attention import Grid, Points
from attention import functional as AF
from attention.pointops import knn
from suite.run_record import quality_metrics
import warm_python

HALF = [torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: one intra-op thread (tests/conftest.py)
# A few roundings of a bfloat16 (2^-8) / float16 (2^-11) value: the output's own rounding and the projections'.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# Kernels: the hazards that float32 normalisation removes
# --------------------------------------------------------------------------------------------

def randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def unit(d: int) -> torch.Tensor:
    return torch.eye(d)[0]


def offset_column_underflow(gen):
    """Key 0 is opposite to every query: its column of softmax weights (e^-32) is 0 in float16, and so is
    eps = 1e-9, so the column normalisation was 0 / 0."""
    q = 4 * unit(4) + 0.1 * randn(gen, 1, 1, 8, 4)
    k = q.clone()
    k[..., 0, :] = -4 * unit(4)
    return AF.offset_attention, (q, k, randn(gen, 1, 1, 8, 5)), {}


def external_row_underflow(gen):
    """Token 0 is opposite to every memory slot: the softmax over tokens gives it e^-32 in every slot, 0 in float16,
    so its row normalisation was 0 / 0."""
    q = 4 * unit(4) + 0.1 * randn(gen, 1, 1, 8, 4)
    q[..., 0, :] = -4 * unit(4)
    mem = 4 * unit(4) + 0.1 * randn(gen, 6, 4)
    return AF.external_attention, (q, mem, randn(gen, 6, 4)), {}


def taylor_sum_overflow(gen):
    """The sum of 1024 values of about 100 is over float16's 65504: the numerator was inf."""
    q, k = randn(gen, 1, 1, 16, 4), randn(gen, 1, 1, 1024, 4)
    return AF.taylor_linear_attention, (q, k, 100 + randn(gen, 1, 1, 1024, 3)), {}


def elu_sum_overflow(gen):
    """sum_j phi(k_j) v_j^T over 1024 keys with values of about 100 is over 65504: the numerator was inf."""
    q, k = randn(gen, 1, 1, 16, 4), randn(gen, 1, 1, 1024, 4)
    return AF.elu_linear_attention, (q, k, 100 + randn(gen, 1, 1, 1024, 3)), {}


def focal_logit_overflow(gen):
    """q = k with entries of about 200: the logits q.k / sqrt(d) (about 1e5) overflowed float16 to inf, and the
    softmax of a row holding inf is NaN. With a mask and a bias, as on grids."""
    q = 200 * randn(gen, 1, 2, 3, 9, 8)  # (B, heads, windows, queries, d)
    k = torch.cat([q, randn(gen, 1, 2, 3, 4, 8)], dim=-2)  # each query's own key among the keys
    mask = torch.ones(3, 9, 13, dtype=torch.bool)
    mask[..., -2:] = False
    return AF.focal_attention, (q, k, randn(gen, 1, 2, 3, 13, 8)), {"mask": mask, "bias": randn(gen, 2, 1, 9, 13)}


def dilated_logit_overflow(gen):
    """q = k with entries of about 200 on a 4 x 5 grid: the centre key's logit overflowed float16 to inf."""
    q = 200 * randn(gen, 1, 2, 20, 8)
    return AF.dilated_attention, (q, q.clone(), randn(gen, 1, 2, 20, 8), (4, 5), 3, 2), {}


def point_logit_overflow(gen):
    """Attention over indexed keys (focal and dilated on point sets): q = k with entries of about 200, each point
    its own first neighbour."""
    q = 200 * randn(gen, 6, 16)  # 6 points, 2 heads of 8
    index = torch.cat([torch.arange(6).view(6, 1), torch.randint(0, 6, (6, 3), generator=gen)], dim=1)  # (6, 4)
    return AF.index_attention, (q, q.clone(), randn(gen, 6, 16), index, 2), {}


def softmax_plain_logit_overflow(gen):
    """softmax attention in plain ops (``fused=False``, for a gradient penalty): q = k with entries of about 200,
    unscaled, gave logits over float16's range."""
    q = 200 * randn(gen, 1, 2, 6, 8)
    return AF.softmax_attention, (q, q.clone(), randn(gen, 1, 2, 6, 8), 1.0, False), {}


def offset_unscaled_logits(gen):
    """PCT's logits are unscaled: similar tokens give logits of about 100 that differ by about 1, which bfloat16
    rounds to steps of 0.5 (a 15% error in the output when the logits' matmul ran in bfloat16)."""
    q = 10 * unit(8) + 0.3 * randn(gen, 1, 1, 16, 8)
    return AF.offset_attention, (q, q.clone(), randn(gen, 1, 1, 16, 8)), {}


HAZARDS = [
    (offset_column_underflow, torch.float16),
    (external_row_underflow, torch.float16),
    (taylor_sum_overflow, torch.float16),
    (elu_sum_overflow, torch.float16),
    (focal_logit_overflow, torch.float16),
    (dilated_logit_overflow, torch.float16),
    (point_logit_overflow, torch.float16),
    (softmax_plain_logit_overflow, torch.float16),
    (offset_unscaled_logits, torch.bfloat16),
]


@pytest.mark.parametrize(("case", "dtype"), HAZARDS, ids=[c.__name__ for c, _ in HAZARDS])
def test_kernel_normalises_in_float32_under_autocast(case, dtype):
    """Half-precision inputs (exactly representable, as a projection under autocast gives them): the output has
    their dtype, is finite, matches the float64 result up to its own rounding, and so do the gradients."""
    kernel, args, kwargs = case(torch.Generator().manual_seed(0))
    floats = [torch.is_tensor(a) and a.is_floating_point() for a in args]  # an index stays as it is
    args = tuple(a.to(dtype).requires_grad_() if f else a for a, f in zip(args, floats))
    kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
    as64 = [a.detach().double().requires_grad_() if f else a for a, f in zip(args, floats)]
    expected = kernel(*as64, **{k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()})
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (expected * weight).sum().backward()

    with torch.autocast("cpu", dtype=dtype):
        out = kernel(*args, **kwargs)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[dtype]
    (out.double() * weight).sum().backward()
    grads = torch.cat([a.grad.flatten() for a, f in zip(args, floats) if f])
    assert torch.isfinite(grads).all()
    # all gradients together: a saturated softmax gives q a gradient of 1e-300 in float64 and 0 in float16
    assert rel_err(grads, torch.cat([a.grad.flatten() for a, f in zip(as64, floats) if f])) < TOL[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
def test_softmax_attention_needs_no_upcast(dtype):
    """SDPA accumulates in float32 itself: unscaled logits of about 1e5, over float16's range, stay exact."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (200 * randn(gen, 1, 2, 32, 8)).to(dtype), (200 * randn(gen, 1, 2, 32, 8)).to(dtype), \
        randn(gen, 1, 2, 32, 8).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        out = AF.softmax_attention(q, k, v, scale=1.0)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, AF.softmax_attention(q.double(), k.double(), v.double(), scale=1.0)) < TOL[dtype]


def test_kernels_keep_float32_and_float64_outside_autocast():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        q, k, v = (randn(gen, 1, 2, 12, 4).to(dtype) for _ in range(3))
        for kernel in (AF.offset_attention, AF.taylor_linear_attention, AF.elu_linear_attention, AF.focal_attention):
            assert kernel(q, k, v).dtype == dtype
        assert AF.dilated_attention(q, k, v, (3, 4)).dtype == dtype
        assert AF.external_attention(q, k[0, 0], v[0, 0]).dtype == dtype


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
def test_knn_under_autocast_matches_float32(dtype):
    """Neighbourhoods (PCT's grouping, dilated and focal on point sets) must not depend on the precision: half-
    precision distances are rounded to about 1e-3 of |x|^2 and reorder near neighbours."""
    xyz = torch.rand(2, 256, 3, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=dtype):
        idx = knn(xyz[:, :64], xyz, 16)
    assert torch.equal(idx, knn(xyz[:, :64], xyz, 16))


# --------------------------------------------------------------------------------------------
# Mixers: every variant, every layout, both half-precision types
# --------------------------------------------------------------------------------------------

DIM = 32


def mixer_grads(mixer, x, layout, dtype):
    """Output and (input, parameter) gradients of a fixed random projection of the output, under autocast."""
    mixer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = mixer(x, layout)
    weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y.float() * weight).sum().backward()  # backward outside autocast, as Lightning calls it
    grads = torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in mixer.parameters() if p.grad is not None])
    return y.detach(), grads


SERVED = [(name, kind) for name in attention.names() for kind in ("grid", "points")
          if kind in attention.get(name).layouts]


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
@pytest.mark.parametrize(("name", "kind"), SERVED, ids=[f"{n}-{k}" for n, k in SERVED])
def test_mixer_under_autocast_close_to_float32(name, kind, dtype):
    torch.manual_seed(0)
    mixer = attention.build(name, dim=DIM).train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, DIM, generator=gen)
    layout = Grid(8, 8) if kind == "grid" else Points(torch.rand(2, 64, 3, generator=gen))
    y32, g32 = mixer_grads(mixer, x, layout, None)
    y, g = mixer_grads(mixer, x, layout, dtype)
    assert y.dtype == dtype
    assert torch.isfinite(y).all() and torch.isfinite(g).all()
    assert rel_err(y, y32) < TOL[dtype]
    assert rel_err(g, g32) < TOL[dtype]


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

# run.py once per argument list, in one process (one start-up for all), with `16-mixed` on CPU meaning float16
# autocast and a GradScaler as on a GPU instead of Lightning's fallback to bf16-mixed.
LAUNCHER = r"""
import json, os, runpy, sys
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

lightnings_choice = _AcceleratorConnector._check_and_init_precision

def check_and_init_precision(self):
    if self._precision_flag == "16-mixed" and self._accelerator_flag == "cpu":
        return MixedPrecision("16-mixed", "cpu")  # float16 autocast and a GradScaler
    return lightnings_choice(self)

_AcceleratorConnector._check_and_init_precision = check_and_init_precision
run_py, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(run_py))  # as `python run.py` does
for args in runs:
    sys.argv = [run_py, *args]
    runpy.run_path(run_py, run_name="__main__")
"""

# Per task: its smallest run, the precisions it runs at, and the metrics that must match float32's. Every job is
# seeded alike, so the first batch meets the same weights: these metrics are computed before, or one step after,
# the first update. The GAN runs without validation (one FID, at test) and is compared with float32 below.
ALL = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"]
TASK_RUNS = {
    "modelnet": ([*TINY, "attn=offset", "trainer.fast_dev_run=true"], ALL, ("val/loss", "test/loss")),
    "shapenet": (["task=shapenet", "data=parts", "data.npoints=128", "data.train_per_category=2",
                  "data.val_per_category=1", "data.test_per_category=1", "data.batch_size=4", "data.eval_batch_size=4",
                  "trainer.enable_progress_bar=false", "attn=linear_elu", "trainer.fast_dev_run=true"],
                 ALL, ("val/loss", "test/loss")),
    "segmentation": ([*SEG_TINY, "attn=linear_taylor", "trainer.fast_dev_run=true"], ALL,
                     ("train/loss_epoch",)),  # one step's main + aux loss (metrics.json: no per-step values)
    "gan": ([*GAN_TINY, "attn=external", "trainer.max_steps=1", "+trainer.limit_val_batches=0",
             "eval.num_samples=2", "metrics.reference_samples=2"], ALL[1:], ()),
}


@pytest.fixture(scope="module")
def task_runs(env, tmp_path_factory):  # noqa: F811 - env is the imported fixture
    def build(out):
        runs = [["-m", *args, "logger=none", f"trainer.precision={','.join(precisions)}",
                 f"hydra.sweep.dir={out / task}"] for task, (args, precisions, _) in TASK_RUNS.items()]
        runs[list(TASK_RUNS).index("gan")].append(f"metrics.cache_dir={out / 'fid'}")
        proc = warm_python.run([sys.executable, "-c", LAUNCHER, str(ROOT / "run.py"), json.dumps(runs)],
                               cwd=env["HOME"], env={**env, "OMP_NUM_THREADS": "1"},  # 2 threads on 2 busy cores spin
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    return once_per_worker(tmp_path_factory, "precision", build)[0]


@pytest.mark.xdist_group("precision")  # one xdist worker runs the task_runs fixture, once
@pytest.mark.parametrize("task", list(TASK_RUNS))
def test_task_trains_in_mixed_precision_close_to_float32(task_runs, task):
    _, precisions, close = TASK_RUNS[task]
    jobs = sorted((task_runs / task).glob(f"*_{task}_*"))
    assert len(jobs) == len(precisions)
    metrics = {}
    for job, precision in zip(jobs, precisions):  # jobs are numbered in sweep order
        assert f"trainer.precision={precision}" in (job / ".hydra" / "overrides.yaml").read_text()
        metrics[precision] = quality_metrics(json.loads((job / "metrics.json").read_text()))
        bad = {k: v for k, v in metrics[precision].items() if not math.isfinite(v)}
        assert not bad, (precision, bad)
    assert all(m.keys() == metrics[precisions[0]].keys() for m in metrics.values())
    for precision in precisions[1:]:
        for key in close:
            assert metrics[precision][key] == pytest.approx(metrics["32-true"][key], rel=2e-2), (precision, key)


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
@pytest.mark.parametrize("attn", ["self", "external"])
def test_gan_networks_under_autocast_close_to_float32(attn, dtype):
    """SAGAN / EAGAN's G and D (attention switched on: sigma = 1) and both losses under autocast. The losses are
    float32; bfloat16's 1% on images comes from G's three up-sampling blocks, attention or not."""
    from tasks.gan import d_loss_fake, d_loss_real, g_loss
    from tasks.nets.sagan import Discriminator, Generator

    options = {"self": {"heads": 1, "qk_ratio": 8, "v_ratio": 2, "kv_pool": 2, "scale": 1.0},
               "external": {"memory": 8}}[attn]
    torch.manual_seed(0)
    G = Generator({"name": attn, **options}, z_dim=16, channels=32, num_classes=10)
    D = Discriminator({"name": attn, **options}, channels=32, num_classes=10)
    with torch.no_grad():
        for net in (G, D):
            net.attn.sigma.fill_(1.0)  # 0 at initialisation: the block would hide its mixer
    gen = torch.Generator().manual_seed(1)
    z, y = torch.randn(8, 16, generator=gen), torch.randint(10, (8,), generator=gen)
    real = torch.rand(8, 3, 32, 32, generator=gen) * 2 - 1
    results = []
    for autocast in (None, dtype):
        with torch.autocast("cpu", dtype=autocast or dtype, enabled=autocast is not None):
            fake = G(z, y)
            out_real, out_fake = D(real, y), D(fake, y)
            losses = torch.stack([d_loss_real("hinge", out_real) + d_loss_fake("hinge", out_fake),
                                  g_loss("hinge", out_fake)])
        assert losses.dtype == torch.float32
        results.append((fake.detach(), torch.cat([out_real, out_fake]).detach(), losses.detach()))
    (fake32, out32, loss32), (fake, out, loss) = results
    assert torch.isfinite(fake).all() and torch.isfinite(out).all() and torch.isfinite(loss).all()
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert rel_err(fake, fake32) < tol
    assert rel_err(out, out32) < tol
    assert rel_err(loss, loss32) < tol


def test_gan_manual_optimisation_goes_through_the_grad_scaler(tmp_path):
    """float16 on CPU with Lightning's GradScaler: every D and G update is scaled (each of its losses), unscaled,
    stepped and the scale updated, per optimizer, in that order; the networks stay finite."""
    from datamodules import Digits
    from tasks.gan import GAN

    adam = {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 2e-4, "betas": [0.5, 0.999], "eps": 1e-6}
    torch.manual_seed(0)
    dm = Digits(batch_size=4, batches_per_step=2, flip=False, seed=0)
    module = GAN(num_classes=dm.num_classes, class_names=dm.class_names, resolution=32,
                 model={"z_dim": 16, "g_channels": 16, "d_channels": 16}, attn={"name": "external", "memory": 8},
                 optim={"generator": adam, "discriminator": adam}, d_steps=2)
    precision = MixedPrecision("16-mixed", "cpu")
    trainer = L.Trainer(max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        plugins=[precision], default_root_dir=str(tmp_path))
    scaler, calls = precision.scaler, []
    names = {}

    def spy(method):
        original = getattr(scaler, method)

        def record(*args, **kwargs):
            opt = args[0] if args and isinstance(args[0], torch.optim.Optimizer) else None
            calls.append((method, names.get(id(opt))) if opt is not None else method)
            return original(*args, **kwargs)

        setattr(scaler, method, record)

    for method in ("scale", "unscale_", "step", "update"):
        spy(method)

    class Names(L.Callback):
        def on_train_start(self, trainer, pl_module):
            opt_g, opt_d = trainer.optimizers
            names.update({id(opt_g): "G", id(opt_d): "D"})

    trainer.callbacks.append(Names())
    trainer.fit(module, datamodule=dm)

    # D backs up its real and its generated images' terms one after the other (tasks/gan.py): two scaled losses
    update = lambda net, losses: [*["scale"] * losses, ("unscale_", net), ("step", net), "update"]  # noqa: E731
    assert calls == 3 * (update("D", 2) + update("D", 2) + update("G", 1))
    assert trainer.global_step == 3  # generator updates, whether or not the scaler skipped them
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0
    for p in module.parameters():
        assert torch.isfinite(p).all()
    opt_g, opt_d = trainer.optimizers
    assert opt_d.state and opt_g.state  # some updates were taken, not all skipped for inf gradients


# --------------------------------------------------------------------------------------------
# trainer.precision=*-true: the whole module converted, the metrics kept
# --------------------------------------------------------------------------------------------

class _Metrics(L.LightningModule):
    def __init__(self):
        super().__init__()
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        from tasks.metrics.part_iou import PartIoU

        self.net = torch.nn.Linear(3, 2)
        self.loss, self.acc, self.iou = MeanMetric(), MulticlassAccuracy(3), PartIoU([[0, 1], [2]], 3)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_true_precision_keeps_the_metrics_dtypes(precision):
    """Lightning's half `*-true` precisions convert the whole LightningModule (`module.to(dtype)`), which converts
    torchmetrics' floating states too; suite.true_precision.MetricDtypes puts them back after the conversion. In
    bfloat16 a mean of 1,000 losses of 1.0 came out 0.256: the sum stopped at 256."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

    from suite.true_precision import MetricDtypes

    module, keep = _Metrics(), MetricDtypes()
    keep.setup(None, module, "fit")
    plugin = DoublePrecision() if precision == "64-true" else HalfPrecision(precision)
    module = plugin.convert_module(module)
    assert module.net.weight.dtype == (torch.float64 if precision == "64-true" else plugin._desired_input_dtype)
    if precision != "64-true":  # converted (torchmetrics guards .double(), which DoublePrecision calls, not .to)
        assert module.loss.mean_value.dtype == module.iou.iou_sum.dtype == plugin._desired_input_dtype
    keep.on_fit_start(None, module)
    assert module.loss.mean_value.dtype == module.loss.weight.dtype == torch.float32
    assert module.iou.iou_sum.dtype == module.iou.shapes.dtype == torch.float64
    assert module.acc.tp.dtype == torch.long  # integer counts: never converted
    with plugin.forward_context():  # where Lightning runs the steps that update metrics
        for _ in range(1000):
            module.loss.update(torch.tensor(1.0))
        module.iou.update(torch.tensor([[0, 1, 1]]), torch.tensor([[0, 1, 0]]), torch.tensor([0]))
    assert module.loss.compute().item() == 1.0
    assert module.iou.compute()["instance_miou"].item() == 0.5  # parts 0 and 1: 1 of 2 points each
    module.loss.reset()  # a reset gives the kept dtype back, not the converted one
    assert module.loss.mean_value.dtype == torch.float32


@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
@pytest.mark.parametrize("precision", ["16-mixed", "16"])
def test_16_mixed_on_a_cpu_is_float16_with_a_grad_scaler(accelerator, precision, tmp_path):
    """`trainer.precision=16-mixed` on a CPU: Lightning by itself ran bf16-mixed (a warning) while the run's config,
    W&B and report row said 16-mixed; suite.true_precision.float16_on_cpu gives it float16 autocast and a
    GradScaler, as on a GPU. bf16-mixed is left to Lightning."""
    from suite.true_precision import float16_on_cpu

    if accelerator == "auto" and torch.cuda.is_available():
        pytest.skip("auto chooses the GPU here")
    kwargs = {"accelerator": accelerator, "precision": precision}
    float16_on_cpu(kwargs)
    trainer = L.Trainer(**kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    assert trainer.precision == "16-mixed"
    assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.scaler is not None
    with trainer.precision_plugin.forward_context():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
    kwargs = {"accelerator": accelerator, "precision": "bf16-mixed"}
    float16_on_cpu(kwargs)
    assert kwargs == {"accelerator": accelerator, "precision": "bf16-mixed"}
