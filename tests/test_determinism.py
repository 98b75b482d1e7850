"""``trainer.deterministic=true`` (suite/determinism.py): what it sets before the Trainer and CUDA start. That two GPU
runs of one seed are identical, and a resumed one equals an uninterrupted one, is tests/gpu/test_cuda_tasks.py's to
show on the GPU; the formulations that replace the ops without a deterministic CUDA kernel are checked against the
torch ops in tests/tasks/test_deterministic.py."""

from __future__ import annotations

import os

import pytest

from suite import determinism


@pytest.mark.parametrize("setting, given, expected", [
    (True, None, ":4096:8"),        # set for cuBLAS before CUDA starts
    ("warn", None, ":4096:8"),      # Lightning's warn_only mode too
    (True, ":16:8", ":16:8"),       # the user's own setting is kept
    (False, None, None),            # not deterministic: nothing set
])
def test_configure_sets_the_cublas_workspace_unless_given(monkeypatch, setting, given, expected):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that monkeypatch restores what configure sets
    if given is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
    determinism.configure({"deterministic": setting, "accelerator": "auto"})
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == expected



@pytest.mark.parametrize("given", [None, ":4096:8"])
def test_warns_of_a_late_setting_only_when_it_set_it_itself(monkeypatch, caplog, given):
    # CUDA already in use when the run starts (a bench, a notebook): a setting made now may come too late for cuBLAS,
    # one the user gave in the environment (as the warning asks) did not
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    if given is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
    monkeypatch.setattr(determinism.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(determinism.torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level("WARNING", logger="suite.determinism"):
        determinism.configure({"deterministic": True, "accelerator": "auto"})
    warned = [r.getMessage() for r in caplog.records if "CUDA was initialised" in r.getMessage()]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert len(warned) == (1 if given is None else 0), warned
