"""Every task's training steps in this process, watched for host synchronisations (tests/test_host_syncs.py on the
CPU, tests/gpu/test_cuda_tasks.py on a GPU). A module of its own, as tests/fixture_cache.py, so both can import it.

A host synchronisation inside a training step (``.item()``, ``bool(tensor)``, ``nonzero``, a boolean mask, a copy
to the CPU) makes the CPU wait for the GPU to finish every queued kernel before it can queue the next: the GPU then
idles while Python catches up, once per such call. Lightning's loop around the step synchronises where it logs;
the step itself, its backward pass and its metrics' updates need not, and so must not.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from test_run import GAN_TINY, SEG_TINY, TINY

ROOT = Path(__file__).resolve().parents[1]
# The smallest run of each task (as the end-to-end tests run them); every task's default attention variant.
TASKS = {
    "modelnet": [*TINY, "attn=offset"],
    "shapenet": ["task=shapenet", "data=parts", "data.npoints=128", "data.train_per_category=2",
                 "data.val_per_category=1", "data.test_per_category=1", "data.batch_size=4", "data.eval_batch_size=4",
                 "trainer.enable_progress_bar=false"],
    "gan": [*GAN_TINY, "attn=self"],
    "segmentation": [*SEG_TINY, "attn=external"],
    "classification": ["task=classification", "data.batch_size=4", "data.eval_batch_size=4",
                       "trainer.enable_progress_bar=false"],
}


def build(overrides: list[str]):
    """(data module set up for fit, task) of a run.py command line, composed as run.py composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from suite.compose import apply_attn_preset, build_datamodule, build_task

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "logger=none"])
    apply_attn_preset(cfg, overrides)
    L.seed_everything(int(cfg.seed), workers=True)
    datamodule = build_datamodule(cfg, "fit")
    return datamodule, build_task(OmegaConf.to_container(cfg, resolve=True), datamodule)


class Watch:
    """What watches the steps. Each training step and backward pass is watched, what runs inside them to update the
    weights (an optimiser's step, which also calls Lightning's closure: the step and backward pass again watched
    inside it) is not: a stack of ``begin(watching)``/``end()``, whose top says whether ops are watched now. Used as a
    context manager around the whole fit."""

    def __init__(self):
        self._stack: list[bool] = []

    @property
    def watching(self) -> bool:
        return bool(self._stack) and self._stack[-1]

    def begin(self, watching: bool) -> None:
        self._stack.append(watching)
        self.changed()

    def end(self) -> None:
        self._stack.pop()
        self.changed()

    def changed(self) -> None:
        """Called whenever :attr:`watching` may have changed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class SyncRecorder(TorchDispatchMode, Watch):
    """Records every op that makes the host wait for a device while watching, with the Python stack that called it.

    On the CPU nothing waits, so the ops are named: reading a value (``_local_scalar_dense``: ``.item()``,
    ``bool()``, ``float()``, ``.tolist()`` of a one-element tensor), ops whose output size depends on the values
    (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` without
    ``output_size``, ``bincount``, ``histc``), comparisons that return a Python bool (``equal``, ``allclose``) and
tensors made from Python data (``lift_fresh``: ``torch.tensor(...)``, ``torch.as_tensor(number, device=...)``),
which on a GPU are a blocking copy from the host (an H200 caught ``TrainLoss.update`` making one a step).
    ``everywhere``: watch every op while the mode is on (a context manager), not only between :meth:`begin` and
    :meth:`end`."""

    VALUE_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "nonzero_static", "argwhere",
                 "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                 "histc", "lift_fresh", "lift_fresh_copy"}

    def __init__(self, everywhere: bool = False):
        TorchDispatchMode.__init__(self)
        Watch.__init__(self)
        self.everywhere = everywhere
        self.seen: list[tuple[str, str]] = []

    @staticmethod
    def synchronises(name: str, args, kwargs) -> bool:
        if name in SyncRecorder.VALUE_OPS:
            return True
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # boolean masks: a nonzero inside
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None)
        return name == "repeat_interleave" and len(args) == 1 and kwargs.get("output_size") is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (self.watching or self.everywhere) and self.synchronises(func._schema.name.split("::")[-1], args, kwargs):
            self.seen.append((str(func), "".join(traceback.format_stack(limit=24)[:-1])))
        return func(*args, **kwargs)

    def report(self) -> str:
        return "\n".join(f"{op} from\n{stack}" for op, stack in self.seen[:3])


class CudaSyncErrors(Watch):
    """On a GPU: torch's own sync debug mode, which raises at any synchronising CUDA call (the real thing), on
    while watching."""

    def changed(self):
        torch.cuda.set_sync_debug_mode("error" if self.watching else "default")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _unwatched(fn, watch: Watch):
    def unwatched(*args, **kwargs):
        watch.begin(False)
        try:
            return fn(*args, **kwargs)
        finally:
            watch.end()

    return unwatched


@contextmanager
def _gpu_code_paths(watch: Watch):
    """On the CPU, the code a GPU runs where the two differ: the kNN selection that never asks the host
    (``attention.pointops.SYNC_FREE_DEVICES``), and farthest point sampling unwatched: on a GPU it is one Triton
    kernel (``attention/fps_triton.py``), on the CPU a loop over the centres that is not what a GPU runs (the CUDA
    test watches the real one)."""
    import attention.pointops as pointops
    import tasks.nets.pct as pct

    devices, fps = pointops.SYNC_FREE_DEVICES, pct.farthest_point_sample
    pointops.SYNC_FREE_DEVICES, pct.farthest_point_sample = (*devices, "cpu"), _unwatched(fps, watch)
    try:
        yield
    finally:
        pointops.SYNC_FREE_DEVICES, pct.farthest_point_sample = devices, fps


@contextmanager
def _watched(module, watch: Watch, warmup: int):
    steps = [0]  # training steps begun

    def wrap(fn, counts: bool):
        def watched(*args, **kwargs):
            steps[0] += counts
            watch.begin(steps[0] > warmup)
            try:
                return fn(*args, **kwargs)
            finally:
                watch.end()
        return watched

    names = ("training_step", "manual_backward" if not module.automatic_optimization else "backward")
    originals = {name: getattr(module, name) for name in names}
    for name, fn in originals.items():
        setattr(module, name, wrap(fn, counts=name == "training_step"))
    hooks = [register_optimizer_step_pre_hook(lambda *_: watch.begin(False)),
             register_optimizer_step_post_hook(lambda *_: watch.end())]
    # F.one_hot with a class count checks its values with .item() on the CPU only (on CUDA the scatter's device-side
    # assert checks them): not a synchronisation on a GPU, so not watched (SAGAN's generator)
    real_one_hot, F.one_hot = F.one_hot, _unwatched(F.one_hot, watch)
    try:
        with watch:
            yield
    finally:
        F.one_hot = real_one_hot
        for hook in hooks:
            hook.remove()
        for name in names:
            delattr(module, name)  # the class's methods again


def train_watched(overrides: list[str], watch: Watch, accelerator: str = "cpu", steps: int = 3,
                  warmup: int = 1) -> int:
    """Fit ``steps`` training steps of the run ``overrides``, no validation, with ``watch`` around each step and
    backward pass after the first ``warmup`` steps (which fill caches once: attention geometry built on the CPU and
    copied to the device, cuBLAS handles), not the optimiser updates themselves (their step counters live on the
    CPU); returns the steps taken."""
    datamodule, module = build(overrides)
    trainer = L.Trainer(max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator=accelerator, devices=1)
    with _watched(module, watch, warmup), _gpu_code_paths(watch) if accelerator == "cpu" else nullcontext():
        trainer.fit(module, datamodule=datamodule)
    return trainer.global_step
