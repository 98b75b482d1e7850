"""Training throughput per task and the share of step time spent in attention (``bench.tasks=true``).

Each task runs one short epoch of its demo recipe on generated data (``bench.task_overrides``), built from the
real configs exactly as a run builds it (``suite/compose.py``), with data loading in the loop. The clock starts
after ``bench.task_warmup`` batches: samples/s counts the samples of the later batches over the time from the end
of the last warm-up batch to the end of the last batch (loading included). Every attention mixer of the
network carries module hooks timing its forward and its backward (from the gradient reaching its output to
the gradient reaching its input); their sum over the measured steps' time is attention's share. On a GPU every
time is read from CUDA events after the epoch (:class:`Marks`): nothing in the measured steps waits for the GPU.

With ``bench.task_pct`` (on by default), PCT's two tasks among ``bench.task_names`` (modelnet, shapenet) also
compare their network with the channel-first formulation it replaces (``benchmarks.baselines.channel_first``,
the same weights; ``benchmarks/pct.py`` has the method): the task built from the real configs with
``attn=offset`` and ``bench.task_pct_overrides``, one training batch of its data, training steps (forward, the
task's loss, backward, SGD with momentum 0.9) of the two networks alternating, ``bench.task_pct_rounds`` rounds.
``bench.task_compile=true`` measures both under ``torch.compile`` too (steady step and compile time; minutes).

``bench.task_deterministic=true`` measures each task twice, with ``trainer.deterministic`` off and on (deterministic
kernels, and ``tasks/deterministic.py``'s replacements on a GPU): what the repeatable runs of docs/scale.md cost.
The bench then sets ``CUBLAS_WORKSPACE_CONFIG`` (as ``suite/determinism.py`` does) before it starts, for both.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import attention

log = logging.getLogger("bench")


class Marks:
    """Points in a device's timeline, read after the run: CUDA events on a GPU (recording one does not wait for the
    GPU, so the measured steps run as in training; a ``synchronize`` in every mixer hook, as before, kept the host
    from queueing ahead and inflated every task's step), ``perf_counter`` on the CPU, whose ops run as called."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def seconds(self, start, end) -> float:
        """Seconds from ``start`` to ``end``; on a GPU, waits for ``end`` to be reached."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class AttentionClock:
    """Marks (start, end) of every forward and backward inside an :class:`attention.Mixer` of ``module``, appended
    to ``spans``."""

    def __init__(self, module, marks: Marks):
        self.marks, self.spans, self._start = marks, [], {}
        self.mixers = [m for m in module.modules() if isinstance(m, attention.Mixer)]
        self.handles = []
        for m in self.mixers:
            self.handles += [m.register_forward_pre_hook(lambda mod, args: self._begin(mod, "f")),
                             m.register_forward_hook(lambda mod, args, out: self._end(mod, "f")),
                             m.register_full_backward_pre_hook(lambda mod, grad_out: self._begin(mod, "b")),
                             m.register_full_backward_hook(lambda mod, grad_in, grad_out: self._end(mod, "b"))]

    def _begin(self, mod, phase):
        self._start[(id(mod), phase)] = self.marks.now()

    def _end(self, mod, phase):
        start = self._start.pop((id(mod), phase), None)
        if start is not None:
            self.spans.append((start, self.marks.now()))

    def seconds(self, spans) -> float:
        return sum(self.marks.seconds(start, end) for start, end in spans)

    def remove(self):
        for h in self.handles:
            h.remove()


def _timer_callback(clock: AttentionClock):
    import lightning as L

    from suite.callbacks import batch_size

    class StepTimer(L.pytorch.callbacks.Callback):
        """Per training batch: (start mark, end mark, samples, the clock's attention spans within it)."""

        def __init__(self):
            self.steps = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start, self._first = clock.marks.now(), len(clock.spans)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append((self._start, clock.marks.now(), batch_size(batch), clock.spans[self._first:]))

    return StepTimer()


def measure_task(task: str, attn: str, overrides: list[str], s: dict, device, deterministic: bool = False) -> dict:
    import lightning as L
    from hydra import compose

    from suite.compose import apply_attn_preset, build_datamodule, build_task

    overrides = [f"task={task}", *overrides, f"attn={attn}", "logger=none"]
    cfg = compose(config_name="config", overrides=overrides)
    apply_attn_preset(cfg, overrides)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg, "fit")
    module = build_task(OmegaConf.to_container(cfg, resolve=True), datamodule)
    marks = Marks(device)
    clock = AttentionClock(module, marks)
    timer = _timer_callback(clock)
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=1,
                        limit_train_batches=s["task_batches"] + s["task_warmup"], limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], precision="32-true", deterministic=deterministic)
    trainer.fit(module, datamodule=datamodule)
    clock.remove()
    steps = timer.steps[s["task_warmup"]:]
    if not steps:
        raise RuntimeError(f"task={task}: the epoch has {len(timer.steps)} batches, not more than "
                           f"bench.task_warmup={s['task_warmup']}; give it more data in bench.task_overrides.")
    first = timer.steps[s["task_warmup"] - 1][1] if s["task_warmup"] else steps[0][0]
    seconds = [marks.seconds(start, end) for start, end, _, _ in steps]  # read now: one wait for the device
    attention_s = sum(clock.seconds(spans) for _, _, _, spans in steps)
    recipe = " ".join(o for o in overrides if o.startswith("experiment="))
    return {"task": task, "attn": attn, "recipe": recipe, "deterministic": deterministic, "batches": len(steps),
            "samples_per_s": sum(n for _, _, n, _ in steps) / marks.seconds(first, steps[-1][1]),
            "step_ms": 1e3 * statistics.median(seconds), "attention_share": attention_s / sum(seconds),
            "mixers": len(clock.mixers)}


def task_throughput(s: dict, device) -> list[dict]:
    rows = []
    quiet = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.WARNING)
    try:
        runs = [(task, attn, det) for task in s["task_names"] for attn in s["task_attn"]
                for det in ((False, True) if s.get("task_deterministic") else (False,))]
        if s.get("task_deterministic"):
            from suite.determinism import configure

            configure({"deterministic": True})  # CUBLAS_WORKSPACE_CONFIG, for both of each pair
        for task, attn, det in runs:
            started = time.perf_counter()
            try:
                row = {**measure_task(task, attn, list(s["task_overrides"].get(task) or []), s, device, det),
                       "status": "ok"}
            except Exception as err:  # noqa: BLE001 - one task failing must not lose the benchmark
                log.exception("bench: task=%s attn=%s failed", task, attn)
                row = {"task": task, "attn": attn, "recipe": "", "deterministic": det, "batches": 0,
                       "samples_per_s": float("nan"), "step_ms": float("nan"), "attention_share": float("nan"),
                       "mixers": 0, "status": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}"}
            rows.append(row)
            log.info("task %-12s attn %-10s%s %8.1f samples/s, step %.1f ms, attention %.0f%% (%.0f s)", task, attn,
                     " deterministic" if det else "", row["samples_per_s"], row["step_ms"],
                     100 * row["attention_share"], time.perf_counter() - started)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        torch.use_deterministic_algorithms(False)  # Lightning's deterministic Trainer leaves it on
    return rows


# --------------------------------------------------------------------------------------------
# PCT's networks against their channel-first formulation (bench.task_pct)
# --------------------------------------------------------------------------------------------

PCT_TASKS = ("modelnet", "shapenet")


def _pct_step_inputs(task: str, module, batch):
    """(network inputs, target, loss(logits, target)) as the task's training step computes its loss."""
    if task == "modelnet":
        smoothing = module.smoothing
        return (batch["points"],), batch["label"], lambda logits, y: F.cross_entropy(logits, y,
                                                                                      label_smoothing=smoothing)
    smoothing = module.hparams.label_smoothing
    return ((module._inputs(batch), batch["category"]), batch["parts"],
            lambda logits, y: F.cross_entropy(logits, y, label_smoothing=smoothing))


def measure_pct(task: str, overrides: list[str], s: dict, device) -> list[dict]:
    """Training steps of ``task``'s network and of its channel-first formulation, alternating on one batch."""
    import lightning as L
    from hydra import compose

    from benchmarks.baselines import channel_first
    from benchmarks.pct import compare
    from suite.compose import apply_attn_preset, build_datamodule, build_task

    overrides = [f"task={task}", *overrides, "attn=offset", "logger=none"]
    cfg = compose(config_name="config", overrides=overrides)
    apply_attn_preset(cfg, overrides)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg, "fit")
    module = build_task(OmegaConf.to_container(cfg, resolve=True), datamodule)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in next(iter(datamodule.train_dataloader())).items()}
    inputs, target, loss = _pct_step_inputs(task, module, batch)
    ours = module.net.to(device)
    rows = compare(ours, channel_first(ours), inputs, target, loss, s["task_pct_rounds"], device,
                   compile_too=bool(s.get("task_compile")), modes=("train",))
    return [pct_row(task, target.shape[0], inputs[0].shape[1], r) for r in rows]


def pct_row(task: str, size: int, points: int, r: dict, status: str = "ok") -> dict:
    """A table row from one of ``benchmarks.pct.compare``'s rows (``r``), measured on batches of ``size``."""
    return {"task": task, "batch": size, "points": points, "form": r["form"],
            "reference_samples_per_s": size / r["reference_s"], "suite_samples_per_s": size / r["suite_s"],
            "reference_step_ms": 1e3 * r["reference_s"], "suite_step_ms": 1e3 * r["suite_s"],
            "speedup": r["ratio"], "speedup_of_minima": r["ratio_min"], "rounds": r["rounds"],
            "compile_s_reference": r.get("compile_s_reference"), "compile_s_suite": r.get("compile_s_suite"),
            "status": status}


def pct_throughput(s: dict, device) -> list[dict]:
    """:func:`measure_pct` for each PCT task in ``bench.task_names``; a failure is a row with its status."""
    rows = []
    for task in [t for t in s["task_names"] if t in PCT_TASKS]:
        started = time.perf_counter()
        try:
            measured = measure_pct(task, list((s.get("task_pct_overrides") or {}).get(task) or []), s, device)
        except Exception as err:  # noqa: BLE001 - one task failing must not lose the benchmark
            log.exception("bench: PCT comparison for task=%s failed", task)
            nan = float("nan")
            unmeasured = {"form": "eager", "reference_s": nan, "suite_s": nan, "ratio": nan, "ratio_min": nan,
                          "rounds": 0}
            measured = [pct_row(task, 0, 0, unmeasured,
                                f"failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")]
        for row in measured:
            log.info("PCT %-9s %-8s channel-first %.1f samples/s, suite %.1f samples/s: %.2fx (%.0f s)", task,
                     row["form"], row["reference_samples_per_s"], row["suite_samples_per_s"], row["speedup"],
                     time.perf_counter() - started)
        rows += measured
    return rows
