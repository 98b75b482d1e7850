"""Loading published weights into the suite's networks: ``model.weights=PATH`` and its kin.

One loader for every network and every file the papers released:

1. the file is read with ``torch.load(weights_only=True)``: nothing that runs code. What training scripts store
   beside the weights is read as data: ``argparse.Namespace`` (DeiT, DilateFormer) as itself, and the yacs
   ``CfgNode`` of Focal-Transformer's (and Swin's) ``save_checkpoint`` as a plain ``OrderedDict`` (yacs need not
   be installed, and no yacs code runs);
2. the state dict is taken out of its container: a plain state dict (PCT_Pytorch's ``model.t7``), or the entry
   ``state_dict`` (StudioGAN, Lightning), ``model`` (DeiT, DilateFormer, Focal) or ``net``; a network whose
   official evaluation scores an EMA of the weights names that entry first in ``official_ema_keys`` (EAMLP:
   ``state_dict_ema``, which timm's ``CheckpointSaver`` writes beside ``state_dict``), and the loader logs it;
3. ``module.``, which ``nn.DataParallel`` puts before every key, is dropped;
4. keys already in the network's own layout load as they are, and so do the entries of a task checkpoint under
   ``net.`` (a Lightning checkpoint of ``task=classification``, say); otherwise the network's ``from_official``
   maps the official layout to its own (renames, 1x1 convs to linears, ...);
5. the result must fit exactly: every tensor of the network placed, none left over, shapes equal. Anything else
   is one message naming the option, the missing, unexpected and mis-shaped keys, and what the file holds.

A network declares a key map by two class attributes (see ``tasks/nets/pct.py``)::

    official_weights: ClassVar[str]          # which released files, from which repository
    official_ema_keys: ClassVar[tuple[str, ...]] = ()  # optional: entries read before the others (EMA weights)
    @staticmethod
    def from_official(state) -> dict: ...    # official keys -> this network's keys

The state dict formats are the papers' own, so no library maps them (timm's ``checkpoint_filter_fn`` covers
timm's models only); this module is the one place that reads them.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from attention.errors import UserError

log = logging.getLogger(__name__)

# task -> {weights option -> the network class it loads into}, by import path; task=classification's network is the
# backbone its model config names (tasks/nets/backbones/registry.py). Read by :func:`released_weights`.
NETWORKS = {
    "modelnet": {"weights": "tasks.nets.pct.PCT"},
    "shapenet": {"weights": "tasks.nets.pct.PCTPartSeg"},
    "gan": {"g_weights": "tasks.nets.sagan.Generator", "g_ema_weights": "tasks.nets.sagan.Generator",
            "d_weights": "tasks.nets.sagan.Discriminator"},
}


def released_weights(task: str, model: Mapping, option: str) -> str | None:
    """The released files that ``model.<option>`` of ``task`` loads (the network's ``official_weights``), found
    before the network is built, for the messages of the start-up checks; None when it has none."""
    from hydra.utils import get_class

    if task == "classification" and option == "weights":
        from .backbones import registry

        cls = registry.get(str(model.get("name"))) if model.get("name") in registry.names() else None
    else:
        path = NETWORKS.get(task, {}).get(option)
        cls = get_class(path) if path else None
    return getattr(cls, "official_weights", None)


CONTAINER_KEYS = ("state_dict", "model", "net", "model_state_dict")  # where checkpoints keep their weights
WRAPPER_PREFIXES = ("module.",)  # nn.DataParallel / DDP: on every key
TASK_PREFIXES = ("net.", "model.", "backbone.", "backbone.net.")  # a network inside a task or wrapper checkpoint
SHOWN = 5  # keys named per list in a message
# Objects that training scripts pickle beside the weights, read as data: a class, or (stand-in, pickled name).
# A CfgNode is a dict subclass with attributes; an OrderedDict takes both its items and its __dict__.
SAFE_GLOBALS = [argparse.Namespace, (OrderedDict, "yacs.config.CfgNode")]


def _is_state(obj) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(torch.is_tensor(v) for v in obj.values())


def _containers(first: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*first, *CONTAINER_KEYS]))


def _entry(obj, containers: Sequence[str]) -> str | None:
    """The first of ``containers`` that holds a state dict in the loaded ``obj``, or None."""
    return next((k for k in containers if isinstance(obj, Mapping) and _is_state(obj.get(k))), None)


def describe(obj, first: Sequence[str] = ()) -> str:
    """What a loaded file holds, in one phrase: its container keys, tensor count and first keys with shapes
    (``first``: entries read before :data:`CONTAINER_KEYS`, as :func:`read_state`)."""
    if _is_state(obj):
        shown = ", ".join(f"{k} {tuple(v.shape)}" for k, v in list(obj.items())[:3])
        return f"a state dict of {len(obj)} tensors (first: {shown})"
    if isinstance(obj, Mapping):
        inner = _entry(obj, _containers(first))
        shown = ", ".join(repr(k) for k in list(obj)[:8])
        return f"a dict with keys [{shown}]" + (f" whose {inner!r} is {describe(obj[inner])}" if inner else
                                                 ", none of them a state dict")
    return f"a {type(obj).__name__}"


def read_state(path: str, option: str, first: Sequence[str] = ()) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict in the file at ``path`` (unwrapped, wrapper prefixes dropped) and a description of the file.

    ``first``: container entries tried before :data:`CONTAINER_KEYS` (a network's ``official_ema_keys``)."""
    if not os.path.isfile(path):
        raise UserError(f"{option}={path} is not a file: pass the path of a weights file (a state dict or a "
                        f"checkpoint that holds one), or drop {option}.")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unreadable, truncated or code-carrying files all need the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{option}={path} cannot be read with torch.load(weights_only=True): {first}. The file is "
                        "corrupt, not a torch file, or pickles objects that could run code. If you trust it, "
                        "re-save only its weights: torch.save(torch.load(PATH, weights_only=False)['model'], "
                        "'weights.pth') (or the entry that holds them), and pass that file.") from None
    what = describe(obj, first)
    entry = _entry(obj, _containers(first))
    state = obj if _is_state(obj) else obj[entry] if entry else None
    if entry in first and not _is_state(obj):  # the user should know which of the file's weights are scored
        raw = [k for k in CONTAINER_KEYS if k != entry and _is_state(obj.get(k))]
        log.info("%s=%s: loading its %r entry, the EMA weights that the official evaluation scores%s", option, path,
                 entry, f" (not {raw[0]!r})" if raw else "")
    if state is None:
        raise UserError(f"{option}={path} holds no state dict: the file is {what}. Expected a state dict, or a "
                        f"dict holding one under one of {list(CONTAINER_KEYS)}.")
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return dict(state), what


def _mismatch(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], skip: Sequence[str]):
    def kept(k):
        return not k.startswith(tuple(skip))
    missing = [k for k in own if k not in state and kept(k)]
    unexpected = [k for k in state if k not in own and kept(k)]
    shapes = [f"{k} {tuple(state[k].shape)} (the network's: {tuple(own[k].shape)})"
              for k in state if k in own and kept(k) and state[k].shape != own[k].shape]
    return missing, unexpected, shapes


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{len(keys)} (" + ", ".join(keys[:SHOWN]) + more + ")" if keys else "none"


def load_weights(net: nn.Module, path: str, option: str = "model.weights", skip: Sequence[str] = (),
                 name: str | None = None, prefixes: Sequence[str] = ()) -> str:
    """Load the weights file ``path`` into ``net`` (module docstring); returns which layout it was in.

    ``skip``: key prefixes left out on both sides (a classifier that a fine-tuning run replaces); ``name``: the
    network as the user chose it (``model.backbone=resnet50``), for messages; ``prefixes``: where the network sits
    in its task's own checkpoints (``G.`` in a ``task=gan`` checkpoint), tried before :data:`TASK_PREFIXES`.
    """
    state, what = read_state(path, option, getattr(net, "official_ema_keys", ()))
    own = net.state_dict()
    candidates = {"own": state}
    for prefix in dict.fromkeys([*prefixes, *TASK_PREFIXES]):  # a task checkpoint: its network's entries only
        if any(k.startswith(prefix) for k in state):
            candidates[f"own ({prefix})"] = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if hasattr(net, "from_official"):
        candidates["official"] = net.from_official(state)
    problems = {layout: _mismatch(own, c, skip) for layout, c in candidates.items()}
    layout = min(problems, key=lambda k: sum(len(p) for p in problems[k]))  # an exact fit, or the nearest
    candidate, (missing, unexpected, shapes) = candidates[layout], problems[layout]
    if missing or unexpected or shapes:
        name = name or type(net).__name__
        official = getattr(net, "official_weights", None)
        maps = (f"{name} reads its own layout and {official}" if official else
                f"{name} has no official key map, so only its own layout (a state dict it saved) loads")
        raise UserError(f"{option}={path} does not fit a {name} (nearest: its {layout} key layout): missing "
                        f"{_listed(missing)}; unexpected {_listed(unexpected)}; wrong shape {_listed(shapes)}. "
                        f"The file is {what}. {maps}. Check that the model options (model.*, attn=...) are the "
                        f"ones the weights were trained with, or pass the matching file.")
    kept = {k: v for k, v in candidate.items() if not k.startswith(tuple(skip))}
    net.load_state_dict(kept, strict=not skip)
    return layout


def take(state: Mapping[str, torch.Tensor], renames: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """``state`` with every key starting with an official prefix renamed to ours (first matching pair wins).

    Keys no pair matches are kept as they are, so the loader names them as unexpected.
    """
    out = {}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out
