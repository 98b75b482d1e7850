"""Shared pytest fixtures."""

from pathlib import Path

import h5py
import numpy as np
import pytest


@pytest.fixture
def modelnet_release():
    """Factory writing a tiny ModelNet40 HDF5 release (official layout) into ``folder``.

    ``make(folder, train_sizes=(5, 4), test_sizes=(6,), points=64, seed=0)`` writes
    ``ply_data_train{i}.h5`` / ``ply_data_test{i}.h5`` ("data" (n, points, 3) float32,
    "label" (n, 1) uint8) and ``shape_names.txt``; it returns
    ``{"train": (points, labels), "test": (points, labels)}``, files concatenated in order.
    """

    def make(folder: Path, train_sizes=(5, 4), test_sizes=(6,), points=64, seed=0):
        rng = np.random.default_rng(seed)
        folder.mkdir(parents=True, exist_ok=True)
        written = {}
        for split, sizes in (("train", train_sizes), ("test", test_sizes)):
            data = [rng.uniform(-1, 1, (n, points, 3)).astype(np.float32) for n in sizes]
            label = [rng.integers(0, 40, (n, 1)).astype(np.uint8) for n in sizes]
            for i, (d, lab) in enumerate(zip(data, label)):
                with h5py.File(folder / f"ply_data_{split}{i}.h5", "w") as f:
                    f["data"] = d
                    f["label"] = lab
            written[split] = (np.concatenate(data), np.concatenate(label)[:, 0].astype(np.int64))
        (folder / "shape_names.txt").write_text("".join(f"name{i}\n" for i in range(40)))
        return written

    return make
