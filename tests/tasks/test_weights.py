"""The published-weights loader (tasks/nets/weights.py): containers, prefixes, key maps and its messages."""

import argparse
import collections
import sys
import types

import pytest
import torch
from torch import nn

from attention.errors import UserError
from tasks.nets.weights import load_weights, read_state


class Toy(nn.Module):
    """A network with an 'official' layout: ``fc1``/``fc2`` there are ``body.0``/``head`` here."""
    official_weights = "Toy's release (a test's own layout)"

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))

    @staticmethod
    def from_official(state):
        names = {"fc1.": "body.0.", "norm.": "body.1.", "fc2.": "head."}
        return {next((new + k[len(old):] for old, new in names.items() if k.startswith(old)), k): v
                for k, v in state.items()}


def official_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    own = Toy().state_dict()
    back = {"body.0.": "fc1.", "body.1.": "norm.", "head.": "fc2."}
    return {next(new + k[len(old):] for old, new in back.items() if k.startswith(old)):
            torch.rand(v.shape, generator=g) if v.is_floating_point() else v for k, v in own.items()}


@pytest.mark.parametrize("container", ["plain", "state_dict", "model+args", "dataparallel"])
def test_official_files_in_their_containers_load_every_tensor(tmp_path, container):
    state = official_state()
    obj = {"plain": state, "state_dict": {"state_dict": state, "step": 7},
           "model+args": {"model": state, "args": argparse.Namespace(lr=5e-4), "epoch": 299},
           "dataparallel": collections.OrderedDict((f"module.{k}", v) for k, v in state.items())}[container]
    torch.save(obj, tmp_path / "w.pth")
    net = Toy().eval()
    assert load_weights(net, str(tmp_path / "w.pth")) == "official"
    assert torch.equal(net.body[0].weight, state["fc1.weight"]) and torch.equal(net.head.bias, state["fc2.bias"])
    assert torch.equal(net.body[1].running_var, state["norm.running_var"])
    x = torch.rand(5, 3)
    h = x @ state["fc1.weight"].T + state["fc1.bias"]
    h = (h - state["norm.running_mean"]) / torch.sqrt(state["norm.running_var"] + 1e-5) * state["norm.weight"] \
        + state["norm.bias"]
    torch.testing.assert_close(net(x), h @ state["fc2.weight"].T + state["fc2.bias"])


def test_own_layout_and_a_task_checkpoint_load(tmp_path):
    source = Toy()
    torch.save(source.state_dict(), tmp_path / "own.pth")
    lightning = {"state_dict": {**{f"net.{k}": v for k, v in source.state_dict().items()},
                                "val_oa_best.max_value": torch.tensor(0.9)}, "epoch": 3}
    torch.save(lightning, tmp_path / "task.ckpt")
    for file, layout in (("own.pth", "own"), ("task.ckpt", "own (net.)")):
        net = Toy()
        assert load_weights(net, str(tmp_path / file)) == layout
        assert torch.equal(net.head.weight, source.head.weight)


def test_classifier_left_out_when_asked(tmp_path):
    state = Toy().state_dict()
    state["head.weight"] = torch.zeros(10, 4)  # another class count
    state["head.bias"] = torch.zeros(10)
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(UserError, match=r"wrong shape 2 \(head.weight \(10, 4\) \(the network's: \(2, 4\)\)"):
        load_weights(Toy(), str(tmp_path / "w.pth"))
    net = Toy()
    load_weights(net, str(tmp_path / "w.pth"), skip=("head.",))
    assert torch.equal(net.body[0].weight, state["body.0.weight"])


def test_files_that_run_code_or_hold_no_weights_are_refused(tmp_path):
    torch.save({"model": Toy()}, tmp_path / "pickled.pth")  # a whole module: unpickling would run its class code
    with pytest.raises(UserError, match="weights_only=True.*re-save only its weights"):
        read_state(str(tmp_path / "pickled.pth"), "model.weights")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "empty.pth")
    with pytest.raises(UserError, match=r"holds no state dict: the file is a dict with keys \['epoch', 'lr'\]"):
        read_state(str(tmp_path / "empty.pth"), "model.weights")
    with pytest.raises(UserError, match="is not a file"):
        read_state(str(tmp_path / "missing.pth"), "model.g_weights")


def test_a_focal_training_checkpoint_with_its_yacs_config_loads_without_yacs(tmp_path, monkeypatch):
    """Focal-Transformer's ``save_checkpoint`` (as Swin's) pickles its yacs ``CfgNode`` beside ``model``. The class
    below pickles as yacs' does (a dict subclass with attributes, module ``yacs.config``); it is gone when the file
    is read, so nothing of it can run: the config comes back as plain data."""
    yacs, config_module = types.ModuleType("yacs"), types.ModuleType("yacs.config")

    class CfgNode(dict):
        def __init__(self, init_dict=None):
            super().__init__(init_dict or {})
            self.__dict__.update({"__immutable__": True, "__deprecated_keys__": set(), "__new_allowed__": False})

    CfgNode.__module__, CfgNode.__qualname__ = "yacs.config", "CfgNode"
    config_module.CfgNode, yacs.config = CfgNode, config_module
    monkeypatch.setitem(sys.modules, "yacs", yacs)
    monkeypatch.setitem(sys.modules, "yacs.config", config_module)
    state = official_state(3)
    config = CfgNode({"MODEL": CfgNode({"TYPE": "focal", "NAME": "focal_tiny_patch4_window7_224"}), "SEED": 0})
    torch.save({"model": state, "optimizer": {}, "max_accuracy": 82.2, "epoch": 299, "config": config},
               tmp_path / "focal-tiny-is224-ws7.pth")
    monkeypatch.delitem(sys.modules, "yacs.config")
    monkeypatch.delitem(sys.modules, "yacs")
    net = Toy()
    assert load_weights(net, str(tmp_path / "focal-tiny-is224-ws7.pth")) == "official"
    assert torch.equal(net.head.weight, state["fc2.weight"])
    read, what = read_state(str(tmp_path / "focal-tiny-is224-ws7.pth"), "model.weights")
    assert "'config'" in what and set(read) == set(state)
