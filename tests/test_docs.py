"""The README and the pages under docs/: every relative link leads somewhere, every page is one hop away, every
``python run.py`` command they show gets through run.py's start-up checks.

The README is kept short and the manual lives in docs/, so a page renamed, a heading reworded or a file moved
by a refactor silently breaks the path a newcomer follows. These tests read the Markdown as text (no
rendering) and resolve each relative link against the file that holds it; a link with a ``#fragment`` must
name a heading of its target, turned into an anchor the way GitHub does it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside fenced code blocks (code may contain brackets)."""
    return LINK.findall(FENCE.sub("", path.read_text()))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", FENCE.sub("", path.read_text()), re.M)
    return {anchor(h) for h in headings}


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: are not checked


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in filter(relative, links(page)):
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: " + "; ".join(broken)


def test_every_docs_page_is_one_hop_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in filter(relative, links(ROOT / "README.md"))}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The helpers themselves: a missing file and a missing heading are found, code blocks are skipped."""
    page = tmp_path / "page.md"
    page.write_text("# Weights & Biases\n\n[a](other.md#x) ![b](img.png)\n```\n[not](a/link.md)\n```\n")
    assert links(page) == ["other.md#x", "img.png"]
    assert anchors(page) == {"weights--biases"}
    assert anchor("What a crash, a NaN or a bad file costs") == "what-a-crash-a-nan-or-a-bad-file-costs"
    assert not relative("https://hydra.cc/docs/") and relative("docs/scale.md#resume")


# --- numbers quoted in the docs, against the commands beside them -----------------------------------------------------
def summary_params(overrides: list[str], out_dir: Path) -> dict[str, int]:
    """What ``python run.py mode=summary <overrides>`` counts as parameters (suite/summary.py: the trainable
    parameters of each network the task summarises), composed as run.py composes it; no FLOPs (the expensive part)."""
    from hydra import compose, initialize_config_dir

    from suite.compose import compose as compose_run

    args = ["mode=summary", "logger=none", *overrides]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    import torch

    with torch.device("meta"):  # shapes only: no memory, no weight initialisation, same parameter counts
        module = compose_run(cfg, args, out_dir).module
    return {name: sum(p.numel() for p in net.parameters() if p.requires_grad)
            for name, net, _ in module.summaries()}


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_parameter_counts_in_running_md_are_what_mode_summary_counts(tmp_path):
    """docs/running.md quotes mode=summary's parameter counts of the segmentation network (three heads) and the GAN
    (two variants, G and D); each is recounted from the network the command builds."""
    text = " ".join((ROOT / "docs" / "running.md").read_text().split())
    seg = re.search(r"ResNet-50 \+ external-attention head ([\d,]+) parameters .*?`attn=self` ([\d,]+) and .*?"
                    r"`model.head=none` ([\d,]+) and", text)
    gan = re.search(r"`attn=self` \(SAGAN, CIFAR-10 conditional\) has G ([\d,]+) and D ([\d,]+) parameters, "
                    r"`attn=external` \(EAGAN\) G ([\d,]+) and D ([\d,]+)\.", text)
    assert seg and gan, "the sentences quoting the counts were reworded: update this test with them"
    base = ["task=segmentation", "model.pretrained=false"]
    for quoted, overrides in zip(seg.groups(), [["attn=external"], ["attn=self"], ["model.head=none"]]):
        assert sum(summary_params([*base, *overrides], tmp_path).values()) == number(quoted), overrides
    for (g, d), attn in zip([gan.groups()[:2], gan.groups()[2:]], ["self", "external"]):
        counts = summary_params(["task=gan", f"attn={attn}"], tmp_path)
        assert (counts["G"], counts["D"]) == (number(g), number(d)), attn


# --- the commands the docs show ---------------------------------------------------------------------------------------
COMMAND = re.compile(r"python run\.py((?:[ \t]+[^\s`#][^\s`]*)*)")  # the arguments, up to a comment or the code's end
# What the commands leave for the reader to fill in, each given a value that exists here.
PLACEHOLDERS = {"<T>": "modelnet", "<X>": "external", "<S>": "0", "<name>": "focal_t", "<date>/<time>": "2026-01-01/00",
                "compare/<time>": "compare/2026-01-01_00-00-00",
                "<entity>/attention-suite/<sweep id>": "me/attention-suite/abc123",
                "<ckpt>": "outputs/modelnet/offset/2026-01-01_00-00-00/checkpoints/last.ckpt"}


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments) of every ``python run.py ...`` in the README and docs/, a command continued over lines
    with ``\\`` read whole; ``...`` (the rest of a command shown before) and Hydra's flags (``-m``, ``--cfg job``:
    how to run, not what) dropped."""
    found = []
    for page in PAGES:
        for n, match in enumerate(COMMAND.finditer(re.sub(r"\\\n\s*", " ", page.read_text())), 1):
            args = match.group(1)
            for placeholder, value in PLACEHOLDERS.items():
                args = args.replace(placeholder, value)
            words = [a.strip("'") for a in args.split() if a != "..."]
            takes_value = [i + 1 for i, a in enumerate(words) if a in ("--cfg", "-c", "--package", "-p")]
            found.append((f"{page.relative_to(ROOT)}#{n}",
                          [a for i, a in enumerate(words) if not a.startswith("-") and i not in takes_value]))
    return found


def one_run_each(args: list[str]) -> list[list[str]]:
    """The runs a command starts, enough to check each value it sweeps: the first value of every sweep
    (``a,b``, ``glob(...)`` over the group's configs), then each other value of each sweep with the rest at their
    first."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    parser = OverridesParser.create()
    choices = []
    for arg in args:
        if "=" not in arg or arg.split("=", 1)[0].lstrip("+") == "report.runs":
            choices.append([arg])
            continue
        override = parser.parse_override(arg)
        key, value = arg.split("=", 1)[0], override.value()
        if isinstance(value, Glob):
            values = value.filter(sorted(p.stem for p in (ROOT / "configs" / key).glob("*.yaml")))
        elif override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [value]
        choices.append([f"{key}={v}" for v in values] or [arg])
    first = [c[0] for c in choices]
    return [first] + [first[:i] + [v] + first[i + 1:] for i, c in enumerate(choices) for v in c[1:]]


COMMANDS = documented_commands()


def test_commands_are_found():
    """The extraction itself: continued lines joined, comments and ``...`` dropped, placeholders filled in, sweeps
    expanded; and the pages hold the commands the README starts with."""
    assert len(COMMANDS) > 40
    by_args = {" ".join(args) for _, args in COMMANDS}
    assert "task=modelnet attn=external" in by_args  # README's first command
    assert ("experiment=imagenet_dilateformer data_dir=/datasets trainer=ddp trainer.devices=8 "
            "trainer.accelerator=gpu trainer.precision=bf16-mixed logger=wandb") in by_args  # 2 lines, comments after
    assert "task=modelnet attn=glob(*) seed=0,1,2" in by_args  # -m and the comment after it dropped
    assert "task=modelnet attn=external" in {" ".join(args) for where, args in COMMANDS if "running" in where}
    assert one_run_each(["attn=self,external", "seed=0,1"]) == [
        ["attn=self", "seed=0"], ["attn=external", "seed=0"], ["attn=self", "seed=1"]]
    assert [r[0] for r in one_run_each(["attn=glob(*,exclude=[offset,self])"])] == [
        "attn=dilated", "attn=external", "attn=focal", "attn=linear_elu", "attn=linear_taylor"]


@pytest.mark.parametrize("where, args", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_passes_the_start_up_checks(where, args, tmp_path, monkeypatch):
    """Each command the docs show, and each run of a sweep it starts, gets through what run.py checks before it
    reads any data (the command line, Hydra's composition, the option types and ranges, the task's own checks): an
    option renamed or a choice removed in the code leaves no command in the docs that ends in an error. Weights
    files and checkpoints the commands name are stood in for by a small torch file at their path, where it can be
    written (relative paths, under a temporary working directory)."""
    import torch
    from hydra import compose, initialize_config_dir

    from suite.cli import check_group_choices, quote_report_runs
    from suite.compose import apply_attn_preset
    from suite.distributed import check_scale_rule
    from suite.validate import check_resolves, check_seed, validate_config

    monkeypatch.chdir(tmp_path)
    stand_in = tmp_path / "weights.pt"
    torch.save({}, stand_in)
    for run in one_run_each(args):
        for i, arg in enumerate(run):
            key, _, value = arg.partition("=")
            if key in ("model.weights", "ckpt_path") and value.endswith((".t7", ".pth", ".ckpt")):
                path = Path(value) if not value.startswith("/") else stand_in
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    torch.save({}, path)
                run[i] = f"{key}={path}"
        run = quote_report_runs(run)
        try:
            check_group_choices(run)  # then an unknown key or a bad value fails the composition
        except SystemExit:
            pytest.fail(f"{where}: `python run.py {' '.join(run)}` is refused on its command line (stderr above)")
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("config", overrides=run)
        if cfg.mode in ("train", "test", "eval", "summary"):  # bench and report check their own options as they run
            apply_attn_preset(cfg, run)
            check_resolves(cfg)
            check_seed(cfg.seed)
            check_scale_rule((cfg.get("optim") or {}).get("scale_lr"))  # as suite.compose.compose, in its order
            validate_config(cfg, run)


# --- options named in the prose -----------------------------------------------------------------------------------
OPTION = re.compile(r"`\+?([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)=")  # `data.aug=true`, `+x.y=`; not `++x.y=` (adds a key)
GROUPS = ("task", "attn", "mode", "data", "model", "logger", "trainer", "experiment")


def option_names(text: str) -> set[str]:
    return set(OPTION.findall(FENCE.sub("", text)))


def composed_keys() -> set[str]:
    """Every dotted key of the config composed with each choice of each group (under the first task it composes
    with), values not resolved; Hydra's own keys included (``hydra.run.dir``)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    def walk(node, prefix=""):
        for key, value in node.items():
            yield prefix + str(key)
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")

    tasks = sorted(p.stem for p in (ROOT / "configs" / "task").glob("*.yaml"))
    keys: set[str] = set()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for group in GROUPS:
            for choice in sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml")):
                for task in [choice] if group == "task" else tasks:
                    try:
                        cfg = compose("config", overrides=[f"task={task}", f"{group}={choice}"],
                                      return_hydra_config=True)
                    except Exception:  # a data set or model of another task
                        continue
                    keys |= set(walk(OmegaConf.to_container(cfg, resolve=False)))
                    break
    return keys


def test_options_named_in_the_prose_exist():
    """An option the text names as `key=value` (outside commands, which the start-up checks above cover) is a key
    of the composed config: one renamed in the code, or a Lightning argument shown without the ``++`` that adds it,
    is an error for the reader who types it."""
    assert option_names("`data.aug=true` and `+x.y=1`, not `++trainer.limit_val_batches=0`") == {"data.aug", "x.y"}
    known = composed_keys()
    missing = [f"{page.relative_to(ROOT)}: {name}" for page in PAGES for name in sorted(option_names(page.read_text()))
               if name not in known]
    assert not missing, f"options the docs name that no composed config has: {missing}"
