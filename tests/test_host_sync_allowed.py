"""The host synchronisations a training step is allowed, counted inside a real Lightning fit: the non-finite guard's
one documented read of the loss, and none for the training loss's running mean (tasks.base.TrainLoss). Every
``.item()``, ``bool(tensor)`` or ``int(tensor)`` dispatches to ``aten::_local_scalar_dense``, which on a GPU waits
for the stream to drain. That every task's step makes none is tests/test_host_syncs.py's.

The fit runs on the CPU with the code paths a GPU takes: kNN's :func:`attention.pointops.smallest_without_sync`
(``SYNC_FREE_DEVICES``) and FPS by ``model.fps=plain`` (on a GPU, FPS is one Triton kernel, no torch loop).
"""

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from suite.guard import NonFiniteGuard
from tasks.modelnet import PointCloudClassification

OPTIM = {"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01, "momentum": 0.9,
                       "weight_decay": 5e-4}}


class HostSyncs(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` calls (tensor -> Python number) while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class RecordSteps(L.Callback):
    """Host syncs from each training batch's start to its end: forward, loss, metric updates, backward and the
    optimizer step, as Lightning runs them (the loggers' own reads come after ``on_train_batch_end``)."""

    def __init__(self):
        self.counts, self.mode = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = HostSyncs()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.counts.append(self.mode.count)


def fit(task, batches, callbacks):
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(task, loader)


def modelnet_task():
    return PointCloudClassification(5, [str(i) for i in range(5)], model={"samples": [32, 16], "neighbours": 8,
                                    "fps": "plain"}, attn={"name": "offset"}, optim=OPTIM, input_points=64)


def modelnet_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [{"points": torch.randn(4, 64, 3, generator=g), "label": torch.randint(0, 5, (4,), generator=g)}
            for _ in range(n)]


def test_the_nan_guard_adds_its_one_documented_sync(monkeypatch):
    """``trainer.on_nan=stop`` reads the loss on the host once a step (suite/guard.py says so; ``off`` saves it)."""
    monkeypatch.setattr("attention.pointops.SYNC_FREE_DEVICES", ("cpu", "cuda"))
    torch.manual_seed(0)
    record = RecordSteps()
    fit(modelnet_task(), modelnet_batches(2), [record, NonFiniteGuard("stop")])
    assert record.counts == [1, 1]


def test_train_loss_mean_drops_non_finite_losses_on_the_device():
    from tasks.base import TrainLoss

    metric = TrainLoss()
    with HostSyncs() as syncs:
        steps = [metric(torch.tensor(x)) for x in (1.0, float("nan"), 3.0, float("inf"), 5.0)]
    assert syncs.count == 0
    assert metric.compute().item() == 3.0  # (1 + 3 + 5) / 3: the NaN and the inf batch count for nothing
    assert [s.item() for s in steps[::2]] == [1.0, 3.0, 5.0] and steps[1].isnan() and steps[3].isnan()
    metric.reset()
    metric.update(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 3.0]))  # weighted, as MeanMetric
    assert metric.compute().item() == 3.5


def test_eval_loss_is_weighted_keeps_non_finite_batches_and_never_asks_the_host():
    """torchmetrics' MeanMetric dropped a NaN evaluation batch (asking the host, with a warning): the split's loss was
    finite over fewer samples, and a diverged network passed trainer.on_nan's check of the evaluation."""
    from tasks.base import EvalLoss

    metric = EvalLoss()
    with HostSyncs() as syncs:
        metric.update(torch.tensor(1.0), 2)
        metric.update(torch.tensor(4.0), 1)
    assert syncs.count == 0
    assert metric.compute().item() == 2.0  # (1 * 2 + 4 * 1) / 3: weighted by batch size
    for bad in (float("nan"), float("inf")):
        metric.reset()
        with HostSyncs() as syncs:
            for value in (1.0, bad, 3.0):
                metric.update(torch.tensor(value), 4)
        assert syncs.count == 0
        result = metric.compute()
        assert result.isnan() if bad != bad else result.isinf(), (bad, result)
