"""Shared pytest fixtures."""

import functools
import http.server
import json
import os
import signal
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from suite.run_dirs import register_resolvers

register_resolvers()  # as run.py does first: the tests that compose configs resolve ${batches:...} and the others

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A shell without job control starts a background command (`make test &`, `nohup make test &`) with SIGINT
    # ignored, and every process it starts inherits that: Ctrl-C then never reached the runs of the tests of what
    # Ctrl-C does (5 of them failed). A handler of its own, unlike an ignored signal, is not inherited across exec:
    # the runs start with SIGINT's default, as from a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two xdist workers on the 2-core CI machine: one intra-op thread each, so that two
    # multi-threaded workers do not spin-wait on each other's cores.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small-tensor tests: on a busy 2-core machine more threads only
    spin-wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.fixture
def unwritable(monkeypatch, tmp_path_factory):
    """``unwritable(folder)``: writing a processed-data cache under ``folder`` fails with EACCES, as in a shared data
    set the user may only read (the tests run as root, whom permission bits do not stop); the user's cache folder
    (``XDG_CACHE_HOME``) is a fresh temporary folder, which it returns."""
    import errno

    import datamodules.cache as cache

    real_replace = os.replace
    denied = []

    def replace(src, dst, *args, **kwargs):  # the last step of every cache write: moving it into place
        if any(Path(dst).is_relative_to(folder) for folder in denied):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    user_cache = tmp_path_factory.mktemp("user-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_cache))
    monkeypatch.setattr(cache, "_said", set(), raising=False)  # the warnings said so far: each test says its own

    def deny(folder: Path) -> Path:
        denied.append(Path(folder))
        return user_cache

    return deny


# ---------------------------------------------------------------------------
# ShapeNet part segmentation releases (official layouts), for tests/datamodules.

SHAPENET_SYNSETS = [
    ("Airplane", "02691156"), ("Bag", "02773838"), ("Cap", "02954340"), ("Car", "02958343"),
    ("Chair", "03001627"), ("Earphone", "03261776"), ("Guitar", "03467517"), ("Knife", "03624134"),
    ("Lamp", "03636649"), ("Laptop", "03642806"), ("Motorbike", "03790512"), ("Mug", "03797390"),
    ("Pistol", "03948459"), ("Rocket", "04099429"), ("Skateboard", "04225987"), ("Table", "04379243"),
]  # fmt: skip
SHAPENET_PART_RANGES = {0: (0, 3), 1: (4, 5), 11: (36, 37), 15: (47, 49)}  # categories the fixtures use


@pytest.fixture
def shapenet_txt_release():
    """Factory writing a tiny official txt release (``..._v0_normal`` layout) into ``folder``.

    ``make(folder, counts={"train": 4, "val": 2, "test": 3}, categories=(0, 1, 11), points=(20, 40), seed=0)``
    writes ``synsetoffset2category.txt`` (all 16 lines), all 16 synset folders, per shape
    ``<synset>/<id>.txt`` with rows ``x y z nx ny nz part`` ("%.6f", part a float) and
    ``train_test_split/shuffled_{split}_file_list.json`` (entries ``shape_data/<synset>/<id>``,
    categories mixed). Shapes cycle through ``categories``, with a random number of points in
    ``points`` (inclusive). Returns ``{split: [(path, category, values (P, 7) float64), ...]}``
    in JSON order, values exactly as written.
    """

    def make(folder: Path, counts=None, categories=(0, 1, 11), points=(20, 40), seed=0):
        counts = counts or {"train": 4, "val": 2, "test": 3}
        rng = np.random.default_rng(seed)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "synsetoffset2category.txt").write_text("".join(f"{n}\t{s}\n" for n, s in SHAPENET_SYNSETS))
        for _, synset in SHAPENET_SYNSETS:
            (folder / synset).mkdir(exist_ok=True)
        (folder / "train_test_split").mkdir(exist_ok=True)
        written, serial = {}, 0
        for split, count in counts.items():
            shapes = []
            for i in range(count):
                category = categories[i % len(categories)]
                lo, hi = SHAPENET_PART_RANGES[category]
                n = int(rng.integers(points[0], points[1] + 1))
                xyz = rng.uniform(-3, 3, (n, 3)) + rng.uniform(-5, 5, 3)  # off-centre, not unit scale
                normals = rng.normal(size=(n, 3))
                normals /= np.linalg.norm(normals, axis=1, keepdims=True)
                part = rng.integers(lo, hi + 1, n)
                values = np.round(np.column_stack([xyz, normals, part]), 6)
                synset = SHAPENET_SYNSETS[category][1]
                path = folder / synset / f"{serial:08x}{seed:04d}.txt"
                serial += 1
                np.savetxt(path, values, fmt="%.6f")
                shapes.append((path, category, values))
            order = rng.permutation(len(shapes))
            shapes = [shapes[j] for j in order]
            entries = [f"shape_data/{p.parent.name}/{p.stem}" for p, _, _ in shapes]
            (folder / "train_test_split" / f"shuffled_{split}_file_list.json").write_text(json.dumps(entries))
            written[split] = shapes
        return written

    return make


@pytest.fixture
def shapenet_h5_release():
    """Factory writing a tiny HDF5 release (``shapenet_part_seg_hdf5_data`` layout) into ``folder``.

    ``make(folder, sizes={"train": (3, 2), "val": (2,), "test": (2, 2)}, points=2048, seed=0)`` writes
    ``ply_data_{split}{i}.h5`` with "data" (n, points, 3) float32, "label" (n, 1) uint8 (0-15) and
    "pid" (n, points) uint8 (global part ids of the sample's category). Returns
    ``{split: (data, label (n,) int64, pid int64)}``, files concatenated in order.
    """

    def make(folder: Path, sizes=None, points=2048, seed=0):
        sizes = sizes or {"train": (3, 2), "val": (2,), "test": (2, 2)}
        rng = np.random.default_rng(seed)
        folder.mkdir(parents=True, exist_ok=True)
        written = {}
        for split, file_sizes in sizes.items():
            arrays = []
            for i, n in enumerate(file_sizes):
                data = rng.uniform(-1, 1, (n, points, 3)).astype(np.float32)
                label = rng.choice(list(SHAPENET_PART_RANGES), (n, 1)).astype(np.uint8)
                pid = np.stack([rng.integers(SHAPENET_PART_RANGES[c][0], SHAPENET_PART_RANGES[c][1] + 1, points)
                                for c in label[:, 0]]).astype(np.uint8)  # fmt: skip
                with h5py.File(folder / f"ply_data_{split}{i}.h5", "w") as f:
                    f["data"], f["label"], f["pid"] = data, label, pid
                arrays.append((data, label[:, 0].astype(np.int64), pid.astype(np.int64)))
            written[split] = tuple(np.concatenate([a[k] for a in arrays]) for k in range(3))
        return written

    return make


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_folder(tmp_path):
    """Serve a fresh folder tmp_path/http on 127.0.0.1 (ThreadingHTTPServer); yields (folder, base URL)."""
    served = tmp_path / "http"
    served.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()



def pytest_collection_modifyitems(config, items):
    """Slow tests (``@pytest.mark.slow``, the two demo runs of about 4 minutes) first: xdist hands tests out in
    collection order, and a demo collected last ran alone on one worker while the other sat idle.

    ``@pytest.mark.cuda`` tests (tests/gpu/) need a CUDA GPU: without one (CI, a laptop) they are reported as skipped
    with the reason; ``make test-gpu`` runs them on a GPU machine."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here); `make test-gpu` "
                                       "runs the `cuda` tests on a GPU machine")
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip)
