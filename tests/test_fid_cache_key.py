"""The key of the cached reference statistics (``metrics.cache_dir``: ``fid_ref_*.npz``, ``prc_ref_*.npz``) names
the computation, not only the images and the weights.

The key was the data set and the weights: statistics computed on a CPU in IEEE float32 were reused by a GPU run with
TF32 convolutions (``trainer.tf32=true``, or torch's default for cuDNN), and the FID compared generated images'
features of one arithmetic with reference statistics of another. No GPU here: the key is read on the CPU with the
CUDA switches toggled and the device named, and a real change of arithmetic on the CPU (torch-fidelity's float64
internal dtype) is held end to end. Weights are a random initialisation saved by the test (nothing downloads).
"""

from __future__ import annotations

import copy
import logging
import shutil

import numpy as np
import pytest
import torch
import torch_fidelity

from suite import tf32
from tasks.metrics import fid


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inception") / "weights.pth"
    torch.save(fid._random_state_dict(seed=3), path)
    return str(path)


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=g)   # (2, 3, 32, 32)


@pytest.fixture
def switches():
    """The TF32 switches as they were, put back after the test."""
    before = tf32.state(), torch.backends.cudnn.enabled
    yield
    torch.set_float32_matmul_precision(before[0][0])
    torch.backends.cudnn.allow_tf32 = before[0][1]
    torch.backends.cudnn.enabled = before[1]


def test_the_key_names_the_device_dtype_tf32_switches_and_torch_fidelity(switches, monkeypatch):
    keys = {}
    for setting in (None, True, False):
        tf32.apply(setting)
        keys[setting] = (fid.computation_id("cuda"), fid.computation_id("cuda:1"), fid.computation_id("cpu"))
    cuda = {k: v[0] for k, v in keys.items()}
    # trainer.tf32: true (matmuls and convolutions TF32), false (both IEEE), torch's defaults (convolutions only)
    assert len({cuda[True], cuda[False]}) == 2
    tf32.apply(False)
    torch.backends.cudnn.allow_tf32 = True          # torch's defaults
    assert fid.computation_id("cuda") not in (cuda[True], cuda[False])
    assert all(v[1] == v[0] for v in keys.values())  # the device's type, not its index
    torch.backends.cuda.matmul.allow_tf32 = True     # the legacy switch is the same state as trainer.tf32's
    assert fid.computation_id("cuda") == cuda[True]
    torch.backends.cudnn.enabled = False
    assert fid.computation_id("cuda") != cuda[True]
    torch.backends.cudnn.enabled = True
    # on a CPU the switches change nothing: one key whatever they say, not a CUDA key
    assert len({v[2] for v in keys.values()}) == 1 and keys[None][2] not in cuda.values()
    assert fid.computation_id("cpu", torch.float64) != fid.computation_id("cpu")
    monkeypatch.setattr(torch_fidelity, "__version__", "99.0")
    assert fid.computation_id("cpu") != keys[None][2]


def test_a_reference_of_another_arithmetic_is_computed_not_reused(tmp_path, weights_file, images, caplog):
    """float32 statistics cached, then asked for by a float64 extractor (torch-fidelity's own option): they were
    returned from the cache; now the float64 ones are computed, and each is cached beside the other."""
    caplog.set_level(logging.INFO, logger="tasks.metrics.fid")
    extractor = fid.load_inception(weights_file)
    extractor64 = copy.deepcopy(extractor).double()   # the process's cached extractor stays float32
    extractor64.feature_extractor_internal_dtype = torch.float64
    float32 = fid.reference_statistics(extractor, images, "toy", weights_file, tmp_path, batch_size=2)
    caplog.clear()
    float64 = fid.reference_statistics(extractor64, images, "toy", weights_file, tmp_path, batch_size=2)
    assert "cache miss" in caplog.text and "cache hit" not in caplog.text
    assert not np.array_equal(float64["mu"], float32["mu"])
    np.testing.assert_allclose(float64["mu"], float32["mu"], rtol=1e-3, atol=1e-4)   # the same images, though
    assert len(list(tmp_path.glob("fid_ref_toy_*.npz"))) == 2
    for extractor_, expected in ((extractor, float32), (extractor64, float64)):
        caplog.clear()
        again = fid.reference_statistics(extractor_, images, "toy", weights_file, tmp_path, batch_size=2)
        assert "cache hit" in caplog.text
        np.testing.assert_array_equal(again["sigma"], expected["sigma"])


def test_a_cpu_reference_is_not_reused_by_a_tf32_gpu_run(tmp_path, weights_file, images, switches, monkeypatch,
                                                           caplog):
    """The extractor's device named "cuda" (the statistics are still computed on the CPU): each TF32 setting is a
    key of its own, none the CPU's; a CPU file renamed to a CUDA key's name is recomputed, not read."""
    caplog.set_level(logging.INFO, logger="tasks.metrics.fid")
    extractor = fid.load_inception(weights_file)
    cpu = fid.reference_statistics(extractor, images, "toy", weights_file, tmp_path, batch_size=2)
    (cpu_file,) = tmp_path.glob("fid_ref_toy_*.npz")
    real = fid.computation_id
    monkeypatch.setattr(fid, "computation_id", lambda device, dtype=torch.float32: real("cuda", dtype))

    tf32.apply(True)
    gpu_file = fid.reference_cache_path(tmp_path, "fid", "toy", fid.weights_id(weights_file), real("cuda"))
    shutil.copy(cpu_file, gpu_file)   # a CPU computation under a TF32 key's name
    caplog.clear()
    fid.reference_statistics(extractor, images, "toy", weights_file, tmp_path, batch_size=2)
    assert "computed under cpu-float32" in caplog.text and "recomputing" in caplog.text
    with np.load(gpu_file) as f:
        assert str(f["computation"]) == real("cuda") and "mm-high-conv-tf32" in real("cuda")

    tf32.apply(False)
    caplog.clear()
    ieee = fid.reference_statistics(extractor, images, "toy", weights_file, tmp_path, batch_size=2)
    assert "cache miss" in caplog.text and "cache hit" not in caplog.text
    np.testing.assert_array_equal(ieee["mu"], cpu["mu"])   # (computed on the CPU all along)
    assert len(list(tmp_path.glob("fid_ref_toy_*.npz"))) == 3
