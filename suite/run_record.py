"""What a train or test run records beside its metrics, for ``mode=report`` (``suite/report.py``).

``metrics.json`` keeps every final metric (``train/*``, ``val/*``, ``test/*``) and gains:

- ``wall_time_s``: seconds from the start of the run (``suite/train.py``, after the imports of what it runs:
  ``import_what_it_runs``) to the end of testing (data set-up included);
  a resumed run adds the time of its earlier parts (``suite.resume.FitRecord``);
- ``peak_memory_bytes`` with ``peak_memory_source``: CUDA's ``torch.cuda.max_memory_allocated`` when the run
  used a GPU, else the process's peak resident set size (:func:`peak_rss`), both reset when the run starts
  (:func:`reset_peak_memory`), so that each job of a local multirun, where the jobs share one process, has its own;
- ``params`` and ``flops``: trainable parameters and forward FLOPs for one sample, counted as ``mode=summary``
  counts them (``suite/summary.py``), after testing;
- ``train_samples_per_sec``: training samples per second of one process (data loading included, validation, the
  first batch and batches that ``torch.compile`` compiled for excluded), when the run trained: the whole-run rate
  of ``suite.callbacks.TrainThroughput``, the meter whose windowed rate the loggers receive;
- ``protocol``: how the test metrics were obtained (:func:`protocol`);
- ``tested``: the checkpoint tested, its file name with the epoch and global step Lightning saved it at (the
  loggers' test rows sit at the end of the fit, or at step 0 for ``mode=test``, not at the tested weights' step);
- ``compile_time_s`` and ``compile_graphs``, with ``trainer.compile=true``: seconds spent compiling the networks
  (torch.compile's tracing and code generation, forward and backward, evaluation and test included) and the graphs
  compiled (``suite/compile.py``);
- ``provenance``: what produced the numbers (:func:`provenance`): the code's git commit for each part of the run
  (a resumed run may have continued under other code), torch's version and the device;
- ``undefined``, only where there are such: the metrics recorded NaN because the split's data leaves them undefined,
  each with the reason (``Task.undefined_metrics``; ``trainer.on_nan``'s check passes over them);
- ``non_finite``, only where there are such: the metrics that are NaN or infinite, each with its value (``"nan"``,
  ``"inf"``, ``"-inf"``), written ``null`` in their place (:func:`metrics_text`; :func:`read_metrics` restores them).

Nothing here may lose a run: a count or measurement that fails is left out with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import resource
import subprocess
import sys
from pathlib import Path, PurePath

from suite import strict_json

log = logging.getLogger(__name__)

# What :func:`record` adds to metrics.json beside the metrics (these differ between two runs of one seed, or, as
# "undefined", are words about the metrics).
RECORD_KEYS = ("wall_time_s", "peak_memory_bytes", "peak_memory_source", "train_samples_per_sec", "params", "flops",
               "protocol", "compile_time_s", "compile_graphs", "provenance", "tested", "undefined", "non_finite")
NON_FINITE = "non_finite"  # metrics.json's key naming the metrics written null: name -> "nan", "inf" or "-inf"
# The W&B config key holding the resolved values of the config keys a `wandb agent` locked to the sweep's values
# (suite.loggers.ResilientWandbLogger.log_hyperparams), where mode=report reads them.
RESOLVED_KEY = "resolved"


def metrics_text(record: dict) -> str:
    """``record`` as metrics.json's text: strict JSON. Python's ``json`` writes a NaN or infinite float as the bare
    tokens ``NaN`` / ``Infinity``, which JSON (RFC 8259) does not have: jq, JavaScript's ``JSON.parse``, Go, Rust's
    serde and pandas' strict readers refuse the whole file, so one undefined kappa made a run's record unreadable to
    everything but Python. Such a metric is written ``null`` instead, as JavaScript writes it, and named under
    ``"non_finite"`` with its value, which :func:`read_metrics` puts back; a non-finite float inside a nested value
    (a protocol, the provenance) is written ``null`` alone."""
    top = {k: v for k, v in record.items() if k != NON_FINITE}
    named = {k: _non_finite_word(v) for k, v in top.items() if isinstance(v, float) and not math.isfinite(v)}
    text = {k: None if k in named else v for k, v in top.items()}
    if named:
        text[NON_FINITE] = named
    return strict_json.dumps(text, indent=2) + "\n"


def _non_finite_word(value: float) -> str:
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def read_metrics(path: str | Path) -> dict:
    """A metrics.json as its run wrote the record: the metrics :func:`metrics_text` wrote ``null`` and named under
    ``"non_finite"`` are floats again (NaN, inf, -inf), and the key is gone. A record written before that (bare
    ``NaN`` tokens, which Python's ``json`` reads) reads as it did. Raises OSError or ValueError (malformed JSON,
    not an object) as ``json.loads`` does."""
    record = json.loads(Path(path).read_text())
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    named = record.pop(NON_FINITE, None)
    for key, word in (named.items() if isinstance(named, dict) else ()):
        if record.get(key, math.nan) is None and word in ("nan", "inf", "-inf"):
            record[key] = float(word)
    return record


def floats(metrics) -> dict[str, float]:
    """Logged metrics (Lightning's ``callback_metrics``, a test's results) as plain floats."""
    return {str(k): float(v) for k, v in metrics.items()}


def quality_metrics(metrics_json: dict) -> dict:
    """metrics.json without the run record: the metrics that a seed reproduces."""
    return {k: v for k, v in metrics_json.items() if k not in RECORD_KEYS}


def declares(config: dict, attribute: str) -> bool:
    """Whether the run's data module class declares ``attribute`` (``datamodules.base``); False when the class cannot
    be imported (a run of another version)."""
    from hydra.utils import get_class

    try:
        return bool(getattr(get_class(str((config.get("data") or {}).get("_target_"))), attribute, False))
    except Exception:  # noqa: BLE001 - an unknown class is a data set that says nothing
        return False


def test_split_is_val(config: dict) -> bool:
    """Whether the run's data module declares that its "test" split is its validation split (no public test
    labels: ``test_split_is_val`` on the class)."""
    return declares(config, "test_split_is_val")


def data_name(config: dict) -> str:
    """The data module's class name (``datamodules.Shapes`` -> ``Shapes``), or ``?``; for a data set that is the
    folder ``data.root`` names (``root_is_the_data``: class folders, a folder of images), with that folder's name
    (``FolderClassification(flowers)``): two such folders are two data sets."""
    data = config.get("data") or {}
    name = str(data.get("_target_") or "?").rsplit(".", 1)[-1]
    if data.get("root") and declares(config, "root_is_the_data"):
        name += f"({PurePath(str(data['root'])).name})"
    return name


def checkpoint_choice(config: dict, tested: str | None) -> str:
    """Which weights were tested: ``best <monitor> (<max|min>)``, ``last``, ``file <name>``, or ``weights
    <name>`` (published weights given as ``model.weights`` / ``model.g_weights``, tested without a checkpoint)."""
    monitor = config.get("monitor") or {}
    name = Path(tested).name if tested else ""
    if not name and config.get("mode", "train") != "train" and config.get("ckpt_path"):
        name = Path(str(config["ckpt_path"])).name
    model = config.get("model") or {}
    weights = model.get("g_ema_weights") or model.get("g_weights") or model.get("weights")
    if not name and config.get("mode", "train") != "train" and weights and (config.get("task") or {}).get(
            "name") != "segmentation":  # segmentation's model.weights is an ImageNet backbone, not a tested model
        return f"weights {Path(str(weights)).name}"
    if name.startswith("best"):
        return f"best {monitor.get('metric')} ({monitor.get('mode')})"
    if not name or name.startswith(("last", "hpc_ckpt")):
        return "last"
    return f"file {name}"


SELECTION = ("checkpoint", "selected_on", "selected_on_part")  # how the tested checkpoint was chosen


def protocol(config: dict, tested: str | None = None, val_is_test: bool | None = None,
             chosen_in: dict | None = None, world_size: int = 1, batches: dict | None = None) -> dict:
    """The evaluation protocol of a run, from its resolved config and the checkpoint it tested.

    Runs whose protocols differ are never averaged together by ``mode=report``. Keys: ``checkpoint`` (see
    :func:`checkpoint_choice`), ``split`` (what the test metrics were measured on), ``selected_on`` (the split
    the checkpoint was chosen on: ``test`` when validation uses the test split, as PCT's reference does), and
    per task what else decides the numbers: test-time augmentation, points, FID/IS sample counts, reference
    split and feature extractor, the segmentation evaluation mode, EMA weights.

    ``val_is_test``: whether the run validated on its test split, as its data module set it up (None: told from
    the config, which misses a data set's defaults: ``data=shapes data.val_per_class=0`` validates on the test
    split with no ``val_fraction`` in its config). ``chosen_in``: the protocol of the run that chose the tested
    checkpoint, where that is another run (``mode=test``, :func:`checkpoint_origin`): its monitor, split and
    part of it decide ``checkpoint``, ``selected_on`` and ``selected_on_part``, not this command's. ``world_size``:
    the run's processes, which a part of a split depends on (:func:`tested_part`). ``batches``: the whole test and
    validation loaders' batch counts, by limit option (:func:`split_batches`), which tell a limit that covers its
    whole split from one that does not (none known: every int limit is taken for a part).
    """
    task = (config.get("task") or {}).get("name")
    data = config.get("data") or {}
    p = {"checkpoint": checkpoint_choice(config, tested)}
    trainer = config.get("trainer") or {}
    batches = batches or {}
    if (part := tested_part(trainer, world_size=world_size, batches=batches.get("limit_test_batches"))) is not None:
        p["tested_part"] = part
    if (part := tested_part(trainer, "limit_val_batches", world_size, batches.get("limit_val_batches"))) is not None:
        p["selected_on_part"] = part  # the checkpoint chosen on part of the validation split
    on_val = test_split_is_val(config)
    if val_is_test is None:
        val_is_test = (on_val or data.get("val_fraction") == 0 or bool(data.get("trainval"))
                       or ("val_size" in data and not data.get("val_size")))
    p = _evaluation(p, config, task, data, on_val, val_is_test)
    if chosen_in is not None:
        p = {k: v for k, v in p.items() if k not in SELECTION[1:]}
        if p["checkpoint"].startswith("best") and str(chosen_in.get("checkpoint", "")).startswith("best"):
            p["checkpoint"] = chosen_in["checkpoint"]
        p.update({k: chosen_in[k] for k in SELECTION[1:] if k in chosen_in})
    return p


def checkpoint_origin(ckpt: str | None) -> dict | None:
    """The protocol of the run that wrote checkpoint ``ckpt`` (for ``mode=test``/``eval``): the one in its
    ``metrics.json``, else one told from its ``resolved_config.yaml``; None when neither is beside it."""
    from omegaconf import OmegaConf

    from suite.checkpoints import run_config_of

    if not ckpt or (saved := run_config_of(ckpt)) is None:
        return None
    try:
        recorded = read_metrics(saved.parent / "metrics.json").get("protocol")
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, dict):
        return recorded
    try:
        config = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
    except Exception:  # noqa: BLE001 - unreadable: this run's own config stands
        return None
    return protocol(config, ckpt) if isinstance(config, dict) else None


def _evaluation(p: dict, config: dict, task, data: dict, on_val: bool, val_is_test: bool) -> dict:
    """:func:`protocol`'s keys for how each task evaluates, added to ``p``."""
    if task == "gan":
        metrics, evaluation = config.get("metrics") or {}, config.get("eval") or {}
        weights = metrics.get("inception_weights")
        if weights is None:
            extractor = "inception-v3-compat"
        elif str(weights).startswith("random"):
            extractor = f"{weights} Inception (not comparable)"
        else:
            extractor = f"inception-v3-compat ({Path(str(weights)).name})"
        reference = metrics.get("reference_samples")
        # the counts the data module generates: data.* follow metrics.num_samples / eval.num_samples unless set
        # themselves (null: as many as training images); a config without them (an older record) has the metrics'
        val = data.get("val_samples", metrics.get("num_samples"))
        test = data.get("test_samples", evaluation.get("num_samples"))
        p.update(split="generated samples",
                 selected_on=f"val FID of {val} samples" if val is not None
                 else "val FID of as many samples as training images",
                 fid_samples=test if test is not None else "as many as training images",
                 fid_reference="train split" + (
                     f" ({reference} drawn at random, seed {metrics.get('reference_seed', 0)})"
                     if reference is not None else ""),
                 feature_extractor=extractor, is_splits=metrics.get("isc_splits"),
                 ema=bool((config.get("ema") or {}).get("enabled")))
        if metrics.get("kid"):   # torch-fidelity's polynomial-kernel KID on the same Inception features
            size = metrics.get("kid_subset_size")
            p.update(kid_subsets=metrics.get("kid_subsets"),
                     kid_subset_size=size if size is not None else "min(1000, generated, reference images)",
                     kid_kernel=f"poly degree {metrics.get('kid_degree')} gamma "
                                f"{metrics.get('kid_gamma') if metrics.get('kid_gamma') is not None else '1/2048'} "
                                f"coef0 {metrics.get('kid_coef0')}")
        p["prc"] = "off"   # torch-fidelity's improved precision/recall, k-NN radii on VGG16 fc2_relu features
        if metrics.get("prc"):
            vgg = metrics.get("vgg16_weights")
            p["prc"] = f"k={metrics.get('prc_neighborhood')}, vgg16 fc2_relu" + (
                "" if vgg is None else f" ({vgg} weights, not comparable)" if str(vgg).startswith("random")
                else f" ({Path(str(vgg)).name})")
        return p
    p.update(split="val" if on_val else "test", selected_on="test" if val_is_test else "val")
    if task in ("modelnet", "shapenet"):
        voting = config.get("eval") or {}
        votes = int(voting.get("votes") or 1)
        p.update(tta="none", points=data.get("npoints"))
        if votes > 1:  # tasks/voting.py: mean softmax over the unscaled cloud and votes - 1 scaled copies
            low, high = voting.get("vote_scale")
            p.update(tta=f"vote x{votes}, anisotropic scale [{low:g}, {high:g}]"
                     + (", cumulative" if voting.get("vote_cumulative") else ""), votes=votes)
        if task == "shapenet":
            p["restrict_to_category"] = bool((config.get("task") or {}).get("restrict_to_category", True))
    elif task == "segmentation":
        evaluation = config.get("eval") or {}
        p.update(eval_mode=evaluation.get("mode"), scales=list(evaluation.get("scales") or [1.0]),
                 flip=bool(evaluation.get("flip")))
        if evaluation.get("mode") == "slide":
            p["stride"] = evaluation.get("stride")
    elif task == "classification":
        p.update(tta="none", crop=data.get("img_size"), ema=bool(((config.get("task") or {}).get("ema") or {})
                                                                 .get("enabled")))
    return p


def tested_checkpoint(path: str, with_config: bool = False) -> dict:
    """``{"checkpoint": file name, "epoch", "step"}`` of checkpoint ``path``, as Lightning saved them, and
    ``"seed"``, the one its run was trained with (its ``resolved_config.yaml``'s), when beside it: a ``mode=test``
    run's own ``seed`` is the test command's (42 unless given), and ``mode=report`` took the tests of three
    checkpoints of seeds 0, 1, 2 for one seed tested three times, counting one of them.

    ``with_config`` (a ``mode=test``/``eval`` run): also ``"config"``, that whole resolved config, by which
    ``mode=report`` groups the test (how the network was trained: a test command composes its own defaults, and
    a 1-epoch checkpoint's test was averaged with 100-epoch ones'). Recorded at test time, as the checkpoint's run
    folder may be moved, deleted or resumed under a new config later."""
    import yaml

    from suite.checkpoint_io import safe_torch_load
    from suite.checkpoints import run_config_of

    state = safe_torch_load(path, f"checkpoint {path}", mmap=True)
    out = {"checkpoint": Path(path).name, "epoch": int(state["epoch"]), "step": int(state["global_step"])}
    try:
        config = yaml.safe_load(saved.read_text()) if (saved := run_config_of(path)) is not None else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        config = None
    if isinstance(config, dict) and "seed" in config:
        out["seed"] = config["seed"]
    if isinstance(config, dict) and with_config:
        out["config"] = config
    return out


def tested_part(trainer: dict, key: str = "limit_test_batches", world_size: int = 1,
                batches: int | None = None) -> str | None:
    """What part of the test split a run's test metrics cover, when not all of it (``trainer.limit_test_batches``,
    ``trainer.fast_dev_run``), else None; with ``key="limit_val_batches"``, of the validation split its checkpoint
    was chosen on. Such metrics were recorded as the whole split's, and ``mode=report`` averaged them with
    whole-split runs; a protocol key keeps them apart and says so. Under DDP the limit is each process's, on its
    strided share of the split: 2 batches under 2 processes are 4 batches of other samples than the first 2, so the
    part names the process count (``world_size``) and is not averaged with one process's.

    ``batches``: the whole loader's batch count (the first process's share under DDP, the largest:
    :func:`split_batches`), where known. An int limit of at least that many, like a float of 1.0, is the whole
    split (Lightning runs ``min(limit, batches)``): such a run was put in a row of its own, apart from the runs it
    equals. Unknown (None), an int limit counts as a part."""
    fast = trainer.get("fast_dev_run")
    if fast:
        part = "1 batch" if fast is True else f"{int(fast)} batches"
        return f"{part} (trainer.fast_dev_run)" if world_size == 1 else (
            f"{part} of each of {world_size} processes' shares (trainer.fast_dev_run)")
    limit = trainer.get(key)
    if limit is None or (isinstance(limit, float) and limit >= 1.0):
        return None
    if isinstance(limit, int) and not isinstance(limit, bool) and batches is not None and limit >= batches:
        return None
    if not limit:
        return f"no batches (trainer.{key}=0)"
    if world_size > 1:
        share = f"{limit:.0%} of the batches" if isinstance(limit, float) else f"{int(limit)} batches"
        return f"{share} of each of {world_size} processes' shares (trainer.{key}={limit:g})"
    if isinstance(limit, float):
        return f"first {limit:.0%} of the batches (trainer.{key}={limit:g})"
    return f"first {int(limit)} batches (trainer.{key}={int(limit)})"


def split_batches(trainer) -> dict[str, int]:
    """The batch counts of a run's whole test and validation loaders, keyed by the option that limits them
    (``limit_test_batches``, ``limit_val_batches``), for :func:`tested_part`: ``len`` of the loaders Lightning ran
    (several: the largest). ``trainer.test()`` lets go of the fit's validation loaders (Lightning's
    ``attach_dataloaders``), so where the fit validated, the data module's validation loader is built again to be
    counted (nothing is loaded). Under DDP each process's loader holds its share; a count is given only where the
    sampler is a ``DistributedSampler`` (Lightning's, or its ``UnrepeatedDistributedSampler``, ours: ranks differ
    by one sample at most), whose first process, this one, has the largest share, so a limit covering it covers
    every process's. A loader without a length, another sampler, or no loader (no test or no validation in this
    process): left out."""
    out = {}
    if trainer is None:
        return out
    if (n := _batches(trainer.test_dataloaders, trainer.world_size)) is not None:
        out["limit_test_batches"] = n
    val = trainer.val_dataloaders
    if val is None and trainer.num_val_batches and getattr(trainer, "datamodule", None) is not None:
        val = trainer.datamodule.val_dataloader()
    if (n := _batches(val, trainer.world_size)) is not None:
        out["limit_val_batches"] = n
    return out


def _batches(loaders, world_size: int) -> int | None:
    """The largest ``len`` of ``loaders`` (a loader, a list or dict of them), None where :func:`split_batches`
    cannot tell."""
    from torch.utils.data import DistributedSampler

    if loaders is None:
        return None
    items = list(loaders.values()) if isinstance(loaders, dict) else (
        list(loaders) if isinstance(loaders, (list, tuple)) else [loaders])
    try:
        lengths = [len(loader) for loader in items]
    except TypeError:  # an iterable without a length
        return None
    if world_size > 1 and not all(isinstance(getattr(loader, "sampler", None), DistributedSampler)
                                  for loader in items):
        return None
    return max(lengths) if lengths else None


def reset_peak_memory() -> None:
    """Start a run's peak memory from what the process holds now: CUDA's peak statistics, and on Linux the peak
    resident set size (``5`` into ``/proc/self/clear_refs`` resets the high-water mark that :func:`peak_rss`
    reads), so that the jobs of a local ``-m`` multirun, which share one process, each record their own peak.
    CUDA's are reset only where this process has used CUDA already (an earlier job's): resetting them creates a
    CUDA context, on the current device before a DDP process has chosen its own (every process's on GPU 0), and on
    a GPU machine for a CPU run too (whose peak RSS then held the context); a fresh context's peak starts at 0."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then counts from the process's start
        pass


def peak_rss() -> int:
    """This process's peak resident set size in bytes: ``VmHWM`` of ``/proc/self/status`` on Linux, the high-water
    mark of the process's own memory, which :func:`reset_peak_memory` resets.

    Not ``getrusage``'s ``ru_maxrss``: the kernel folds into it, at ``exec``, the high-water mark of the process
    that started this one (``exec_mmap``), and no reset clears that. A run that Lightning starts as a second DDP
    process, or that a test or a launcher starts from a process holding 4 GiB, recorded at least those 4 GiB.
    ``getrusage`` is the fallback where there is no ``/proc`` (macOS, where it counts bytes, not KiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return maxrss if sys.platform == "darwin" else maxrss * 1024


CHECKOUT = Path(__file__).resolve().parents[1]


@functools.cache
def code_version() -> str | None:
    """The checkout's git commit (12 hex digits), with ``+dirty`` when tracked files differ from it; None where
    that cannot be told (no git, not a git checkout, a copy of the files). Called first at a run's start
    (``suite/train.py``) and kept: what ran, whatever is edited while it trains.

    Only the checkout itself counts: an installed copy inside some other repository (a virtual environment in a
    project folder) would otherwise report that repository's commit."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top, commit = git("rev-parse", "--show-toplevel"), git("rev-parse", "--short=12", "HEAD")
    if top is None or commit is None or Path(top).resolve() != CHECKOUT:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+dirty" if changes is None or changes else "")


def provenance(device_type: str, code: list | None = None, settings: list | None = None) -> dict:
    """``metrics.json``'s ``provenance``: ``code``, the :func:`code_version` of each part of the run in order
    (``suite.resume.FitRecord`` keeps the earlier parts'; default: this process's), ``torch``'s version,
    ``device``: the GPU's name, or ``cpu``, and for a run resumed under another batch, number of processes,
    accumulation, precision or clipping, ``settings``: each part's, with the step it started at. ``mode=report``
    shows them per row and flags rows whose runs differ, or changed settings."""
    import torch

    device = torch.cuda.get_device_name() if device_type == "cuda" and torch.cuda.is_available() else device_type
    out = {"code": list(code) if code is not None else [code_version()], "torch": torch.__version__,
           "device": device}
    if settings:
        out["settings"] = [dict(part) for part in settings]
    return out


def peak_memory(device_type: str) -> tuple[int, str]:
    """(bytes, source): CUDA's max_memory_allocated on a GPU, else this process's peak RSS."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_memory_allocated"
    return peak_rss(), "cpu_peak_rss"


def count_cost(module) -> dict:
    """``params`` and ``flops`` for one sample, as ``mode=summary`` counts them (every network of the task)."""
    import numpy as np
    import torch

    from suite.summary import summarize

    parts = module.summaries()
    params = flops = 0
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):  # a count must not move any random stream
        for _, net, example in parts:
            param = next(net.parameters())  # the example in the network's device and dtype (trainer.precision=*-true)
            example = tuple(_like(x, param) for x in example) if isinstance(example, tuple) else _like(example, param)
            _, p, f = summarize(net, example)
            params, flops = params + p, flops + f
    random.setstate(state[0])
    np.random.set_state(state[1])
    return {"params": params, "flops": flops}


def _like(x, param):
    """x on ``param``'s device, and in its dtype where x is floating point (an index stays an index)."""
    return x.to(param.device, param.dtype if x.is_floating_point() else None)


def eager_networks(compiled: bool):
    """Inside, compiled networks run eagerly (``suite.compile.eager``); nothing happens when none was compiled."""
    if not compiled:
        return contextlib.nullcontext()
    from suite.compile import eager

    return eager()


def record(module, config: dict, tested: str | None, device_type: str, wall_time: float, meter=None,
           compiler=None, code: list | None = None, settings: list | None = None, val_is_test: bool | None = None,
           chosen_in: dict | None = None, world_size: int = 1) -> dict:
    """The fields above for ``metrics.json`` (``wall_time``: the run's seconds, ``wall_time_s``; ``compiler``:
    the run's ``suite.compile.CompileNetworks``, or None when it compiled nothing; ``code``: the code version of
    each of the run's parts, ``settings``: each part's where they changed, :func:`provenance`; ``val_is_test``
    ``chosen_in`` and ``world_size``: :func:`protocol`'s)."""
    out: dict = {"wall_time_s": wall_time}
    try:
        out["peak_memory_bytes"], out["peak_memory_source"] = peak_memory(device_type)
    except Exception as err:  # noqa: BLE001 - a measurement never loses a run
        log.warning("peak memory not recorded: %s", err)
    rate = meter.rate() if meter is not None else None
    if rate:
        out["train_samples_per_sec"] = rate
    try:
        with eager_networks(compiler is not None):  # counted as mode=summary counts, not compiled for one sample
            out.update(count_cost(module))
    except Exception as err:  # noqa: BLE001
        log.warning("params/FLOPs not recorded in metrics.json: %s", err)
    try:
        batches = split_batches(getattr(module, "_trainer", None))
    except Exception as err:  # noqa: BLE001 - unknown counts: every int limit is taken for a part
        log.warning("the test and validation loaders' batch counts not read: %s", err)
        batches = {}
    out["protocol"] = protocol(config, tested, val_is_test, chosen_in, world_size, batches)
    if tested:
        try:
            out["tested"] = tested_checkpoint(tested, with_config=config.get("mode") in ("test", "eval"))
        except Exception as err:  # noqa: BLE001
            log.warning("the tested checkpoint's step not recorded in metrics.json: %s", err)
    try:
        out["provenance"] = provenance(device_type, code, settings)
    except Exception as err:  # noqa: BLE001
        log.warning("provenance not recorded in metrics.json: %s", err)
    if compiler is not None:
        out.update(compiler.record())
    if undefined := getattr(module, "undefined_metrics", None):
        out["undefined"] = dict(sorted(undefined.items()))
    return out
