"""What ``run.py`` does with the command line before Hydra composes it.

- :func:`quote_report_runs`: ``report.runs=a,b`` as a list rather than a Hydra sweep;
- :func:`check_group_choices`: ``group=unknown`` refused with the group's choices, exit code 2;
- :func:`check_overrides`: the overrides Hydra would refuse (a key that does not exist, ``+key=`` for a key that
  does), refused first with exit code 2 and a fix that works ("did you mean max_epochs?");
- :func:`exit_with_message`: how every user error ends: one message on stderr, exit code 2;
- :func:`sweep_job_ended`, :func:`end_sweep`: a multirun goes on past a failed job and lists the failed ones at
  its end.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("mode", "task", "attn", "data", "model", "trainer", "logger", "experiment")


def exit_with_message(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# A Hydra multirun under its default launcher runs its jobs one after another in this process. One job's failure (a
# loss gone NaN at one learning rate, one variant out of memory) no longer ends the sweep: the job's message (or a
# bug's traceback) is printed when it fails, the next job starts, and the sweep's end lists the failed jobs and exits
# non-zero (:func:`end_sweep`). It used to end at the first failed job, and an overnight sweep of 21 runs stopped at
# the second with 19 never started. An interruption (SIGTERM, Ctrl-C: a SystemExit) still ends the whole sweep. The
# submitit launchers (hydra/launcher=local, slurm) run each job as its own process or cluster job: there the
# submitting process records the failed ones (suite/launchers.py) for the same end.
class SweepJob(NamedTuple):
    number: int
    folder: str
    overrides: list[str]
    error: str | None  # the user-facing message, a bug's exception line, or None: it finished
    bug: bool
    log: str | None = None  # where its messages are, when not printed by this process (a submitit job's stderr)


SWEEP_JOBS: list[SweepJob] = []
SWEEP_BASE = ""  # the sweep's folder


def in_process_sweep(hydra_cfg) -> bool:
    """Whether this job is one of a multirun whose jobs share this process (Hydra's default launcher)."""
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN and str(hydra_cfg.launcher.get("_target_", "")).endswith(
        ".BasicLauncher")


def sweep_job_ended(hydra_cfg, err: BaseException | None = None, message: str | None = None) -> None:
    """Record how a job of an in-process sweep ended: finished (``err`` None), with a user error (``message``, printed
    as a single run prints it) or with a bug (its traceback printed)."""
    global SWEEP_BASE
    SWEEP_BASE = str(hydra_cfg.sweep.dir)
    error, bug = None, False
    if err is not None:
        if message is not None:
            print(f"error: {message}", file=sys.stderr)
            error = message
        else:
            import traceback

            traceback.print_exception(err)
            error, bug = f"{type(err).__name__}: {err}", True
        print(f"(job #{hydra_cfg.job.num} of the sweep, {hydra_cfg.runtime.output_dir}, failed; the sweep goes on "
              "with its next job, and lists the failed ones at its end)", file=sys.stderr)
    SWEEP_JOBS.append(SweepJob(int(hydra_cfg.job.num), str(hydra_cfg.runtime.output_dir),
                               list(hydra_cfg.overrides.task), error, bug))


def release_memory() -> None:
    """What a failed job held (its network, optimizer, data; on a GPU the caching allocator's blocks) for the next."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def end_sweep() -> int | None:
    """At the end of a sweep with failed jobs (:data:`SWEEP_JOBS`): print them, one line each (the job, the
    overrides that set it apart, the first sentence of its message, its log), and how to run them again; returns the
    exit code (2, or 1 when one failed with a bug), None when none failed."""
    failed = [job for job in SWEEP_JOBS if job.error is not None]
    if not failed:
        return None
    common = set.intersection(*(set(job.overrides) for job in SWEEP_JOBS))
    lines = []
    for job in failed:
        own = " ".join(o for o in job.overrides if o not in common) or "its overrides"
        first = re.split(r"(?<=\.)\s+(?=[A-Z`])", job.error.strip(), maxsplit=1)[0]  # its first sentence
        lines.append(f"  #{job.number} {Path(job.folder).name} ({own}): {first[:300]}"
                     + (f" (its log: {job.log})" if job.log else ""))
    finished = len(SWEEP_JOBS) - len(failed)
    print(f"error: {len(failed)} of the sweep's {len(SWEEP_JOBS)} jobs failed ({finished} finished), in "
          f"{SWEEP_BASE}:\n" + "\n".join(lines) + "\nEach job's message (printed when it failed, or in its log) says "
          "what went wrong and how to fix it; its folder keeps what it wrote (run.log). Then the same command with "
          f"`resume=true hydra.sweep.dir={SWEEP_BASE}` runs the failed jobs again (a job continues from its "
          "last checkpoint, if it wrote one) and keeps the finished ones as they are.", file=sys.stderr)
    return 1 if any(job.bug for job in failed) else 2


def quote_report_runs(argv: list[str]) -> list[str]:
    """``report.runs=a,b`` as the list ``report.runs=['a','b']``: Hydra would read the commas as a sweep (and any
    path holding ``:``, ``=`` or spaces needs quoting), so each folder is passed quoted."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "report.runs" and value and value[0] not in "[\"'" and value != "null":
            folders = ",".join("'" + v.replace("'", "\\'") + "'" for v in value.split(",") if v)
            arg = f"{key}=[{folders}]"
        out.append(arg)
    return out


def check_group_choices(argv: list[str]) -> None:
    """Reject ``group=unknown`` before Hydra does, listing the choices, with exit code 2. Sweeps are parsed as
    Hydra parses them: each choice of ``attn=self,offset`` or ``choice(...)`` is checked, and ``glob(...)`` must
    match at least one config of the group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # not ours to report: Hydra's own message names the bad override
        key = override.key_or_group
        if key not in GROUPS or override.value() is None:
            continue
        available = sorted(p.stem for p in (CONFIGS / key).glob("*.yaml"))
        value = override.value()
        if isinstance(value, Glob):
            if not value.filter(available):
                exit_with_message(f"{arg!r} matches no {key} config. Available {key} choices: "
                                  f"{', '.join(available)} (configs/{key}/). Example: "
                                  f"`python run.py -m '{key}=glob(*)'`.")
            continue
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [str(value)]
        for choice in choices:
            if choice and choice != "null" and choice not in available:
                exit_with_message(f"unknown {key} {choice!r}. Available {key} choices: {', '.join(available)} "
                                  f"(configs/{key}/). Example: `python run.py {key}={available[0]}`.")


# Hydra's words for the two override errors that need a better fix (hydra._internal.config_loader_impl).
NO_KEY = re.compile(r"Could not override '([^']+)'")
KEY_THERE = re.compile(r"Could not append to config\. An item is already at '([^']+)'")


def check_overrides(argv: list[str]) -> None:
    """Compose the config as Hydra is about to, so that an override it refuses ends with exit code 2 and a fix
    that works, rather than Hydra's exit code 1 and its advice to add ``+key=``, which creates a key that nothing
    reads:

    - ``trainer.max_epoch=3``: the key does not exist; the message names the keys that do, closest first
      ("did you mean trainer.max_epochs?"), and ``++key=`` for a Trainer argument the config does not list;
    - ``+trainer.max_epochs=3``: ``+`` adds a key, and this one exists: the message gives ``key=`` and ``++key=``;
    - any other override Hydra cannot compose (its own message, in one paragraph).

    A sweep (``-m``) is checked with the first value of each swept override. Hydra's own flags (``--cfg``,
    ``--help``, ...) are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import ConfigCompositionException, HydraException

    if any(arg.startswith("-") and arg not in ("-m", "--multirun") for arg in argv):
        return
    parser = OverridesParser.create()
    overrides, rewritten = [], False
    for arg in (a for a in argv if not a.startswith("-")):
        try:
            override = parser.parse_override(arg)
        except HydraException as err:
            exit_with_message(f"{arg!r} is not an override Hydra can read: {' '.join(str(err).split())} Write "
                              "overrides as key=value (a value with spaces or special characters in quotes).")
        if not override.is_sweep_override():
            overrides.append(arg)
            continue
        rewritten = True
        value = override.value()
        if isinstance(value, Glob):
            matched = value.filter(sorted(p.stem for p in (CONFIGS / override.key_or_group).glob("*.yaml")))
            first = matched[0] if matched else None
        else:
            try:
                first = next(iter(override.sweep_string_iterator()), None)
            except (HydraException, ValueError):  # an interval sweep: nothing to enumerate
                first = None
        if first is None:
            return
        overrides.append(f"{override.get_key_element()}={first}")
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except ConfigCompositionException as err:
        text = " ".join(str(err).split())
        if (missing := NO_KEY.search(text)) is not None:
            exit_with_message(unknown_key(missing.group(1), overrides))
        if (there := KEY_THERE.search(text)) is not None:
            key = there.group(1)
            given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == key), f"+{key}=<value>")
            value = given.split("=", 1)[1] if "=" in given else "<value>"
            exit_with_message(f"{given} adds {key}, but the config has {key} already: set it with `{key}={value}` "
                              f"(or `++{key}={value}`, which sets a key or adds it).")
        if not rewritten:
            exit_with_message(f"{text} (Hydra could not compose the config from the command line's overrides.)")
        return
    except HydraException:  # anything else (a missing plugin, ...): Hydra reports it as it runs
        return
    check_run_dir(cfg, "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir")


def check_run_dir(cfg, key: str) -> None:
    """The run (or sweep) directory can be created: its nearest existing folder is a folder, and writable. Hydra
    creates it before the run starts, where a failure is a traceback."""
    from omegaconf import OmegaConf

    try:
        folder = Path(str(OmegaConf.select(cfg, key, throw_on_resolution_failure=True))).expanduser().absolute()
    except Exception:  # noqa: BLE001 - a directory that does not resolve here: Hydra resolves and reports it
        return
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        problem = f"{existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable (a read-only file system, or a folder that is not yours)"
    else:
        return
    exit_with_message(f"{key}={folder} cannot be created: {problem}. Nothing was run. Give a run directory in a "
                      f"writable folder, e.g. `python run.py {key}=outputs/my-run`, or drop {key} to use the "
                      "default (outputs/<task>/<attn>/<time>, multirun/<time> with -m).")


def unknown_key(key: str, overrides: list[str]) -> str:
    """The message for an override of ``key``, which the composed config lacks, and of every other override the
    config lacks (Hydra names the first only: a user who mistyped three keys learnt of them one run at a time):
    for each, the keys nearest to it by spelling ("did you mean"), then every key its parent has (composed without
    those overrides), once per parent."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    def without(overrides: list[str], key: str) -> list[str]:
        return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != key]

    missing, others, cfg = [key], without(overrides, key), None
    while cfg is None and len(missing) <= len(overrides):
        try:
            with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
                cfg = compose("config", overrides=others, return_hydra_config=any(k.startswith("hydra.")
                                                                                  for k in missing))
        except ConfigCompositionException as err:  # another key the config lacks: named too, then composed without
            found = NO_KEY.search(" ".join(str(err).split()))
            if found is None or found.group(1) in missing:
                break
            missing.append(found.group(1))
            others = without(others, found.group(1))
        except Exception:  # noqa: BLE001 - another override fails otherwise: Hydra's own message names it
            break
    if cfg is None:
        return (f"{key} is not an option of the composed config (and another override fails too); "
                "`python run.py --cfg job` prints the config's keys.")
    described = [describe_missing(cfg, each, overrides) for each in missing]
    text = " ".join(sentence for sentence, _, _ in described)
    listed = {}
    for _, parent, keys in described:
        if keys:
            listed.setdefault(parent, keys)
    for parent, keys in listed.items():
        text += f" The keys of {parent or 'the config'}: {', '.join(keys)}."
    return text


def describe_missing(cfg, key: str, overrides: list[str]) -> tuple[str, str, list[str]]:
    """(what :func:`unknown_key` says of ``key``, the config lacking it: the nearest keys by spelling and a fix;
    the section that lacks it; that section's keys)."""
    from omegaconf import DictConfig

    given = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), f"{key}=<value>")
    value = given.split("=", 1)[1] if "=" in given else "<value>"
    if (inside := missing_inside(cfg, key, given)) is not None:  # key={a:{b:1}}: the key exists, a or b does not
        key, value = inside
    parts = key.split(".")
    node, depth = cfg, 0
    while isinstance(node, DictConfig) and depth < len(parts) - 1 and parts[depth] in node:
        node, depth = node[parts[depth]], depth + 1
    parent = ".".join(parts[:depth])
    wrong = parts[depth]
    keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(wrong, keys, n=3, cutoff=0.6)
    where = f"{parent} has no key {wrong!r}" if parent else f"the config has no top-level key {wrong!r}"
    meant = [".".join([*parts[:depth], c, *parts[depth + 1:]]) for c in close]  # the whole key, corrected
    text = f"{key} is not an option: {where}."
    if meant:
        text += " Did you mean " + " or ".join(meant) + "?"
    if parent == "bench.options":
        # bench.options is null (Hydra adds no key to a {}, and a per-variant defaults entry would make every new
        # variant edit the bench config): a dotted option is added with ++, as a new key is
        return (f"{key} is not in the config: bench.options holds only what the command line adds to "
                f"configs/attn/<variant>.yaml, and a dotted option is added with ++: "
                f"`python run.py mode=bench ++{key}={value}`, or several at once, "
                f"`'bench.options={{{wrong}:{{{'.'.join(parts[depth + 1:]) or '<option>'}:{value}}}}}'`.",
                parent, [])
    if parent == "trainer" and depth == len(parts) - 1 and is_trainer_argument(wrong):
        text += (f" {wrong} is an argument of Lightning's Trainer that the config does not list: give it with ++, "
                 f"`python run.py ++trainer.{wrong}={value}`.")
    elif meant:
        text += f" Example: `python run.py {meant[0]}={value}`."
    return text, parent, keys


def missing_inside(cfg, key: str, override: str) -> tuple[str, str] | None:
    """(the first key missing from the config, its value as given) where ``override`` sets ``key``, which the config
    has, to a dict holding a key it lacks (``bench.limits={bogus:1}``: ``("bench.limits.bogus", "1")``): Hydra names
    only ``key``. None when ``key`` is not a section of the config or the value is not a dict."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(cfg, key, default=None)
    try:
        value = OverridesParser.create().parse_override(override).value()
    except HydraException:
        return None
    if not isinstance(node, DictConfig) or not isinstance(value, dict):
        return None

    def written(value) -> str:  # as the command line writes it
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{written(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ",".join(written(v) for v in value) + "]"
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    def walk(node: DictConfig, value: dict, prefix: str) -> tuple[str, str] | None:
        for name, given in value.items():
            if name not in node:
                return f"{prefix}.{name}", written(given)
            if isinstance(given, dict) and isinstance(node[name], DictConfig):
                if (found := walk(node[name], given, f"{prefix}.{name}")) is not None:
                    return found
        return None

    return walk(node, value, key)


def is_trainer_argument(name: str) -> bool:
    import inspect

    from lightning import Trainer

    return name in inspect.signature(inspect.unwrap(Trainer.__init__)).parameters
