"""The environment under test is the locked one: every package of requirements/lock.txt at the lock's version.

`make` installs the lock into .venv, so a hand-installed build (a newer torch, a CUDA wheel swapped for a CPU
one) fails here instead of passing tests that a fresh clone would fail. For a deliberate run outside the lock
(your own environment, installed from pyproject.toml's ranges), set ATTENTION_UNLOCKED=1: this test is then
reported as skipped, with the reason.
"""

import os
import re

import pytest
from packaging.version import Version

from benchmarks.measure import LOCK, environment_line, lock_mismatches, locked_versions


def test_lock_pins_the_torch_pair_and_the_core_libraries():
    pins = locked_versions()
    assert pins["torch"] == Version("2.14.1") and pins["torchvision"] == Version("0.29.1")
    assert {"lightning", "hydra-core", "wandb", "torch-fidelity", "timm", "torch-geometric", "pytest",
            "pip", "pip-tools"} <= set(pins)
    assert len(pins) > 80  # every transitive dependency, not only the direct ones


@pytest.mark.skipif(os.environ.get("ATTENTION_UNLOCKED") == "1", reason="ATTENTION_UNLOCKED=1: not the locked env")
def test_installed_versions_equal_the_lock():
    wrong = lock_mismatches()
    assert not wrong, (f"this environment is not {LOCK}: " + "; ".join(wrong)
                       + ". `make install` restores it (or run with ATTENTION_UNLOCKED=1 on purpose).")
    assert "requirements/lock.txt` exactly" in environment_line()  # what benchmark tables print


def test_a_version_that_differs_from_the_lock_is_reported(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("torch==2.14.0\n    # via x\npytest==1.0.0+local  # comment\nno-such-package-here==1.0\n")
    wrong = lock_mismatches(lock)
    assert [w.split(":")[0] for w in wrong] == ["no-such-package-here", "pytest", "torch"]
    assert "installed nothing" in wrong[0]
    lock.write_text("torch>=2.4\n")
    with pytest.raises(ValueError, match="not one exact pin"):
        locked_versions(lock)


def test_the_lock_was_resolved_from_this_pyproject():
    """The lock's header names the command `make lock` runs, so a hand-edited or foreign lock is visible."""
    header = LOCK.read_text().split("\n\n", 1)[0]
    assert re.search(r"pip-compile .*--constraint=requirements/pins\.txt.* pyproject\.toml requirements/tools\.in",
                     header), header
