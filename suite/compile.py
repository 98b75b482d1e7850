"""``trainer.compile=true``: the task's networks under ``torch.compile``, its cost counted and logged.

What is compiled: the networks the task names in :meth:`tasks.base.Task.networks` (PCT's ``net``, the GAN's ``G``
and ``D``, the segmentation and classification networks), each *in place* with ``nn.Module.compile``. In place,
rather than ``torch.compile(net)``, because that wraps the network in an ``OptimizedModule`` whose state-dict keys
gain an ``_orig_mod.`` prefix: a compiled run's checkpoints would no longer load into an uncompiled run (nor
``model.weights=`` files into a compiled one), and the optimisers, EMA copies and DDP, which hold the network
itself, would hold the uncompiled one. In place, every checkpoint of a compiled run is that of an uncompiled run.

When: at the start of the first validation (Lightning's sanity check), training or test, not when the Trainer is
built: Lightning's model summary runs the task's one-sample example input through the network at fit start, and
compiled, that batch of one would be one more compilation (dynamo specialises sizes 0 and 1) for nothing.

Recompilations stay bounded: dynamo compiles a graph for what its guards see (shapes, grad mode, ``training``
flags, parameters' ``requires_grad``) and reuses it while they hold. With ``trainer.compile_dynamic=null``
(torch's default) the first graph is static; the first call with another batch size (the last, partial batch of
an epoch, or the evaluation batch size) recompiles once with a symbolic batch dimension, and that graph serves
every later size. Training, evaluation (BatchNorm and dropout in eval mode, no gradients) and testing (inference
mode) each get their graphs in the first epoch, so the count stops growing after it (``tests/test_compile.py``
holds it to that). Each network keeps its own recompile budget (``isolate_recompiles``): the GAN's G and D share
``nn.Module``'s call code, and would otherwise share one limit per code object; that limit is
:data:`RECOMPILE_LIMIT` rather than torch's 8 (see there). Past it, dynamo warns and runs the call eagerly.
torch releases before ``torch.compile`` took ``isolate_recompiles`` and ``recompile_limit`` (2.11, the declared
floor, among them) get the same budget the one way they offer, dynamo's process-wide ``recompile_limit`` raised to
:data:`RECOMPILE_LIMIT` per compiled network (:func:`compile_in_place`; which form is used is feature-detected from
``torch.compile``'s signature, never from the version number).

Cost: the seconds dynamo spent compiling (tracing, the backend's compilation, the backward's, lazily at the first
backward pass), from torch's own counters, and the number of graphs compiled, are logged after every training
epoch as ``train/compile_seconds`` and ``train/compile_graphs`` (cumulative: a count that grows after the first
epoch means recompilation), and written to ``metrics.json`` as ``compile_time_s`` and ``compile_graphs``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import contextmanager

import lightning as L
import torch

from attention.errors import UserError

log = logging.getLogger(__name__)

# The trainer options this module takes (suite/train.py pops them before the rest reaches Lightning's Trainer).
OPTIONS = ("compile", "compile_backend", "compile_mode", "compile_dynamic")
# Compilations of one function within one network before dynamo runs it eagerly (torch's default is 8): a function
# with a graph break, such as PCT's SampleAndGroup.forward (farthest point sampling and kNN branch on tensor values),
# is its own frame, compiled per configuration of the modules that call it (PCT's two groups sample different
# numbers of centres), per mode (training, evaluation without gradients, test in inference mode) and static, then
# dynamic: 2 x 3 x 2 = 12 for PCT, which 8 would cut short in the test stage.
RECOMPILE_LIMIT = 32


def take_options(trainer_kwargs: dict) -> dict:
    """Remove the compile options from ``trainer_kwargs`` (the trainer config as Lightning will get it) and return
    them: ``{"compile": bool, "backend": ..., "mode": ..., "dynamic": ...}``."""
    given = {key: trainer_kwargs.pop(key) for key in OPTIONS if key in trainer_kwargs}
    return {"compile": bool(given.get("compile", False)), "backend": given.get("compile_backend") or "inductor",
            "mode": given.get("compile_mode"), "dynamic": given.get("compile_dynamic")}


def check_options(trainer: Mapping) -> None:
    """The backend exists and ``compile_mode`` is only given to inductor, which alone takes it; types and ranges
    are ``suite.schema.CompileOptions``'. Only checked when ``trainer.compile`` is on: listing torch's backends
    imports dynamo, a second that an uncompiled run does not pay."""
    if not trainer.get("compile"):
        return
    backend = trainer.get("compile_backend") or "inductor"
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise UserError(f"trainer.compile_backend={backend!r} is not a torch.compile backend: use one of "
                        f"{', '.join(sorted(known))} (inductor generates fused kernels and is the one that is faster; "
                        "aot_eager and eager only trace, for debugging), e.g. `python run.py trainer.compile=true "
                        "trainer.compile_backend=inductor`.")
    mode = trainer.get("compile_mode")
    if mode is not None and backend != "inductor":
        raise UserError(f"trainer.compile_mode={mode!r} is an inductor setting, but trainer.compile_backend="
                        f"{backend!r} takes no mode: set trainer.compile_mode=null, or compile with inductor, e.g. "
                        f"`python run.py trainer.compile=true trainer.compile_backend=inductor trainer.compile_mode="
                        f"{mode}`.")


def isolates_recompiles() -> bool:
    """Whether this torch's ``torch.compile`` gives each compiled function its own recompile budget
    (``isolate_recompiles`` and ``recompile_limit`` arguments; torch 2.11 has neither)."""
    import inspect

    return {"isolate_recompiles", "recompile_limit"} <= set(inspect.signature(torch.compile).parameters)


def compile_in_place(net: torch.nn.Module, backend: str = "inductor", mode: str | None = None,
                     dynamic: bool | None = None, networks: int = 1) -> None:
    """``net.compile(...)`` with a budget of :data:`RECOMPILE_LIMIT` compilations, ``networks`` being how many
    networks of the task are compiled alike. Where ``torch.compile`` takes ``isolate_recompiles``, the budget is the
    network's own; elsewhere the networks share ``nn.Module``'s call code and so one process-wide limit, which is
    raised (never lowered) to ``RECOMPILE_LIMIT * networks``: the same budget for each network while they share
    it evenly."""
    if isolates_recompiles():
        net.compile(backend=backend, mode=mode, dynamic=dynamic, isolate_recompiles=True,
                    recompile_limit=RECOMPILE_LIMIT)
        return
    import torch._dynamo.config

    limit = RECOMPILE_LIMIT * max(int(networks), 1)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    net.compile(backend=backend, mode=mode, dynamic=dynamic)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: dynamo's whole-frame compilations (tracing and the backend's
    forward compilation) and AOTAutograd's lazy backward compilations, from torch's own counters."""
    from torch._dynamo.utils import cumulative_time_spent_ns

    return (cumulative_time_spent_ns.get("entire_frame_compile", 0)
            + cumulative_time_spent_ns.get("entire_backward_compile", 0)) / 1e9


def compiled_graphs() -> int:
    """Graphs dynamo has handed to a backend in this process so far (a graph break makes two of one forward)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileNetworks(L.pytorch.callbacks.Callback):
    """Compiles the task's networks in place at the first validation, training or test start (module docstring),
    and logs what compiling cost: ``train/compile_seconds`` and ``train/compile_graphs`` after each training
    epoch, and :meth:`record` for metrics.json."""

    def __init__(self, backend: str = "inductor", mode: str | None = None, dynamic: bool | None = None):
        self.backend, self.mode, self.dynamic = backend, mode, dynamic
        self.names: list[str] = []
        self._start: tuple[float, int] | None = None  # (seconds, graphs) when the networks were compiled

    def compile(self, pl_module) -> None:
        if self._start is not None:
            return
        self._start = (compile_seconds(), compiled_graphs())
        networks = pl_module.networks()
        for name, net in networks:
            compile_in_place(net, self.backend, self.mode, self.dynamic, networks=len(networks))
            self.names.append(name or type(net).__name__)
        log.info("trainer.compile: %s compiled with torch.compile (backend %s, mode %s, dynamic %s); compilation "
                 "happens at each network's first calls", ", ".join(self.names), self.backend, self.mode or "default",
                 "automatic" if self.dynamic is None else self.dynamic)

    def on_validation_start(self, trainer, pl_module) -> None:
        self.compile(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        self.compile(pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self.compile(pl_module)

    def on_predict_start(self, trainer, pl_module) -> None:
        self.compile(pl_module)

    def spent(self) -> tuple[float, int]:
        """(seconds spent compiling, graphs compiled) since the networks were compiled; (0, 0) before."""
        if self._start is None:
            return 0.0, 0
        return compile_seconds() - self._start[0], compiled_graphs() - self._start[1]

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        seconds, graphs = self.spent()
        if trainer.current_epoch == 0:
            log.info("trainer.compile: %d graph(s) compiled in %.1f s during the first epoch", graphs, seconds)
        for logger in trainer.loggers:  # straight to the loggers: a cost, not a metric of the model (metrics.json)
            logger.log_metrics({"train/compile_seconds": seconds, "train/compile_graphs": float(graphs)},
                               step=trainer.global_step)

    def on_test_end(self, trainer, pl_module) -> None:
        seconds, graphs = self.spent()
        log.info("trainer.compile: %d graph(s) compiled in %.1f s in all", graphs, seconds)

    def record(self) -> dict:
        """metrics.json's ``compile_time_s`` and ``compile_graphs``: the whole run's, evaluation and test included."""
        seconds, graphs = self.spent()
        return {"compile_time_s": seconds, "compile_graphs": graphs}


@contextmanager
def eager():
    """Compiled networks run eagerly inside: the run record's one-sample FLOP count (suite/run_record.py) would
    otherwise compile a batch of one under the FLOP counter, a graph used once."""
    with torch.compiler.set_stance("force_eager"):
        yield
