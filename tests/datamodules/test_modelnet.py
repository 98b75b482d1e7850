"""ModelNet40 (HDF5) and ModelNet40PyG data modules on tiny files written here."""

import os

import h5py
import lightning as L
import numpy as np
import pytest
import torch

from attention.errors import UserError
from datamodules import ModelNet40, ModelNet40PyG
from datamodules.base import SPLITS
from datamodules.points.modelnet40 import HDF5_FOLDER, MODELNET40_CLASSES
from datamodules.points.modelnet40_pyg import draw_seed
from datamodules.points.ops import augment_points, unit_sphere


@pytest.fixture
def release(tmp_path, modelnet_release):
    """A valid release under tmp_path/HDF5_FOLDER; returns (root, written arrays)."""
    return tmp_path, modelnet_release(tmp_path / HDF5_FOLDER)


def batches(loader):
    return [(b["points"].clone(), b["label"].clone()) for b in loader]


def test_loads_what_was_written(release):
    root, written = release
    dm = ModelNet40(root=str(root), npoints=32, batch_size=4, eval_batch_size=4)
    assert dm.num_classes == 40 and dm.class_names == MODELNET40_CLASSES
    dm.prepare_data()
    dm.setup()
    assert dm.class_names == [f"name{i}" for i in range(40)]  # read from shape_names.txt
    assert len(dm.train_set) == 9 and len(dm.test_set) == 6
    assert dm.val_set is dm.test_set  # val_fraction == 0: the reference protocol

    test_points, test_labels = written["test"]
    got = list(dm.test_dataloader())
    assert [len(b["label"]) for b in got] == [4, 2]  # nothing dropped or duplicated
    points = torch.cat([b["points"] for b in got])
    labels = torch.cat([b["label"] for b in got])
    assert points.dtype == torch.float32 and points.shape == (6, 32, 3)
    assert labels.dtype == torch.int64 and labels.shape == (6,)
    np.testing.assert_array_equal(points.numpy(), test_points[:, :32])
    np.testing.assert_array_equal(labels.numpy(), test_labels)

    train_points, train_labels = written["train"]
    plain = ModelNet40(root=str(root), npoints=32, augment=False)
    plain.setup()
    for i in range(9):  # files in sorted order: ply_data_train0 then ply_data_train1
        np.testing.assert_array_equal(plain.train_set[i]["points"].numpy(), train_points[i, :32])
        assert plain.train_set[i]["label"].item() == train_labels[i]


def test_root_may_be_the_release_folder(release):
    root, written = release
    dm = ModelNet40(root=str(root / HDF5_FOLDER), npoints=64)
    dm.prepare_data()
    dm.setup()
    np.testing.assert_array_equal(dm.test_set[5]["points"].numpy(), written["test"][0][5])


def test_augmentation_changes_train_samples_but_not_the_cache(release):
    root, written = release
    dm = ModelNet40(root=str(root), npoints=32)
    dm.setup()
    cache = dm.train_set.source._points.copy()
    L.seed_everything(0)
    for _ in range(3):
        for i in range(len(dm.train_set)):
            sample = dm.train_set[i]
            assert sample["points"].shape == (32, 3) and sample["label"].item() == written["train"][1][i]
            assert not np.array_equal(sample["points"].numpy(), written["train"][0][i, :32])
    np.testing.assert_array_equal(dm.train_set.source._points, cache)
    np.testing.assert_array_equal(cache, written["train"][0][:, :32])


def test_augment_points_follows_the_reference_recipe():
    points = np.random.default_rng(1).normal(size=(50, 3)).astype(np.float32)
    before = points.copy()
    out = augment_points(points, np.random.default_rng(7))
    np.testing.assert_array_equal(points, before)  # input untouched
    rng = np.random.default_rng(7)  # replay the documented draws
    ratio = rng.random() * 0.875
    drop = rng.random(50) <= ratio
    scale, shift = rng.uniform(2 / 3, 3 / 2, 3), rng.uniform(-0.2, 0.2, 3)
    expected = (np.where(drop[:, None], points[0], points) * scale + shift).astype(np.float32)
    order = lambda a: a[np.lexsort(a.T)]  # noqa: E731 -- compare as multisets of rows
    assert out.dtype == np.float32 and out.shape == (50, 3)
    np.testing.assert_allclose(order(out), order(expected), rtol=1e-6)
    assert not np.array_equal(out, expected)  # and shuffled


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seeded_runs_give_identical_batches(release, num_workers):
    root, _ = release
    runs = []
    for seed in (3, 3, 4):
        L.seed_everything(seed, workers=True)
        dm = ModelNet40(root=str(root), npoints=32, batch_size=4, num_workers=num_workers)
        dm.setup()
        loader = dm.train_dataloader()
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)  # as Lightning does before every epoch
            epochs.append(batches(loader))
        runs.append(epochs)
    first, again, other = runs
    assert [len(epoch) for epoch in first] == [2, 2]  # 9 samples, batch 4: last partial batch dropped
    for a, b in zip(sum(first, []), sum(again, [])):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(first[0][0][0], first[1][0][0])  # epochs differ
    assert not torch.equal(first[0][0][0], other[0][0][0])  # seeds differ


def test_small_train_set_keeps_its_only_batch(release):
    root, _ = release
    dm = ModelNet40(root=str(root), npoints=32, batch_size=64)
    dm.setup()
    assert [len(b["label"]) for b in dm.train_dataloader()] == [9]


def test_val_fraction_holds_out_a_seeded_stratified_part_of_train(tmp_path, modelnet_release):
    written = modelnet_release(tmp_path / HDF5_FOLDER, train_sizes=(20, 20))
    splits = []
    for _ in range(2):
        dm = ModelNet40(root=str(tmp_path), npoints=16, val_fraction=0.25, seed=5)
        dm.setup()
        splits.append((dm.train_set.indices, dm.val_set.indices))
        assert len(dm.val_set) == 10 and len(dm.train_set) == 30
        assert not set(dm.train_set.indices) & set(dm.val_set.indices)
        assert not dm.val_set.augment and dm.train_set.augment
        np.testing.assert_array_equal(dm.val_set[0]["points"].numpy(), written["train"][0][dm.val_set.indices[0], :16])
    np.testing.assert_array_equal(splits[0][1], splits[1][1])
    dm = ModelNet40(root=str(tmp_path), npoints=16, val_fraction=0.25, seed=6)
    dm.setup()
    assert not np.array_equal(dm.val_set.indices, splits[0][1])


def test_val_split_is_stratified():
    from datamodules.points.base import split_train_val

    labels = np.repeat(np.arange(4), [40, 20, 20, 20])
    train, val = split_train_val(labels, 0.25, seed=0)
    assert np.bincount(labels[val]).tolist() == [10, 5, 5, 5]
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(100))


def test_missing_folder_says_how_to_get_it(tmp_path):
    dm = ModelNet40(root=str(tmp_path / "nowhere"))
    for call in (dm.prepare_data, dm.setup):
        with pytest.raises(UserError) as err:
            call()
        message = str(err.value)
        assert str(tmp_path / "nowhere" / HDF5_FOLDER) in message
        assert "data=shapes" in message and "data.download=true" in message
        assert "ply_data_train0.h5" in message


def test_folder_without_test_files(release):
    root, _ = release
    os.remove(root / HDF5_FOLDER / "ply_data_test0.h5")
    with pytest.raises(UserError, match="no ply_data_train"):
        ModelNet40(root=str(root)).prepare_data()


def test_missing_shape_names_falls_back_to_canonical(release):
    root, _ = release
    os.remove(root / HDF5_FOLDER / "shape_names.txt")
    dm = ModelNet40(root=str(root), npoints=16)
    dm.setup()
    assert dm.class_names == MODELNET40_CLASSES == sorted(MODELNET40_CLASSES)


def test_bad_shape_names(release):
    root, _ = release
    (root / HDF5_FOLDER / "shape_names.txt").write_text("a\nb\n")
    with pytest.raises(UserError, match="shape_names.txt lists 2 class names"):
        ModelNet40(root=str(root), npoints=16).setup()


def rewrite(path, **datasets):
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f[key] = value


def points(n=4, p=64, dtype=np.float32):
    return np.zeros((n, p, 3), dtype=dtype)


def labels(n=4, dtype=np.uint8):
    return np.zeros((n, 1), dtype=dtype)


def _nan(at):
    data = points()
    data[2, 5, 1] = at
    return data


BAD_FILES = {
    "missing data key": (dict(label=labels()), "no 'data' dataset"),
    "missing label key": (dict(data=points()), "no 'label' dataset"),
    "2-D data": (dict(data=np.zeros((4, 64)), label=labels()), "'data' has shape (4, 64)"),
    "last dim not 3": (dict(data=np.zeros((4, 64, 6), np.float32), label=labels()), "expected (n, points, 3)"),
    "too few points": (dict(data=points(p=8), label=labels()), "has 8 points per sample but data.npoints=16"),
    "integer data": (dict(data=points(dtype=np.int32), label=labels()), "'data' has dtype int32"),
    "float labels": (dict(data=points(), label=labels(dtype=np.float32)), "'label' has dtype float32"),
    "label shape": (dict(data=points(), label=np.zeros((4, 2), np.uint8)), "'label' has shape (4, 2)"),
    "length mismatch": (dict(data=points(), label=labels(3)), "'data' has n=4 but 'label' has n=3"),
    "label 40": (dict(data=points(), label=np.array([[0], [1], [40], [41]], np.uint8)), "sample 2 has label 40"),
    "label -1": (dict(data=points(), label=np.array([0, -1, 0, 0], np.int64)), "sample 1 has label -1"),
    "nan": (dict(data=_nan(np.nan), label=labels()), "sample 2 has NaN or infinite"),
    "inf": (dict(data=_nan(-np.inf), label=labels()), "sample 2 has NaN or infinite"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_names_file_and_sample(release, case):
    root, _ = release
    path = root / HDF5_FOLDER / "ply_data_train1.h5"
    datasets, expected = BAD_FILES[case]
    rewrite(path, **datasets)
    with pytest.raises(UserError) as err:
        ModelNet40(root=str(root), npoints=16).setup()
    assert str(path) in str(err.value) and expected in str(err.value)


def test_empty_listed_shard_is_a_bad_file(release):
    root, written = release
    path = root / HDF5_FOLDER / "ply_data_train0.h5"
    rewrite(path, data=points(n=0), label=labels(n=0))  # an interrupted re-export: its 5 samples are gone
    with pytest.raises(UserError, match="holds no samples") as err:
        ModelNet40(root=str(root), npoints=16).setup()
    assert str(path) in str(err.value) and "on_bad_file=skip" in str(err.value)
    dm = ModelNet40(root=str(root), npoints=16, on_bad_file="skip")
    dm.setup()
    assert dm.skipped == [f"{path}: holds no samples"] and len(dm.train_set) == 4


@pytest.mark.parametrize("trim", ["as unzipped", "without lists or val", "without lists"])
def test_shapenet_part_h5_release_is_refused(tmp_path, shapenet_h5_release, trim):
    folder = tmp_path / "hdf5_data"  # what shapenet_part_seg_hdf5_data.zip unpacks to
    shapenet_h5_release(folder, points=32)
    for split in ("train", "val", "test"):
        (folder / f"{split}_hdf5_file_list.txt").write_text(f"ply_data_{split}0.h5\n")
    if trim != "as unzipped":
        for path in folder.glob("*_hdf5_file_list.txt"):
            path.unlink()
    if trim == "without lists or val":  # only the 'pid' part labels tell it apart
        (folder / "ply_data_val0.h5").unlink()
    dm = ModelNet40(root=str(folder), npoints=16)
    for call in (dm.prepare_data, dm.setup):
        with pytest.raises(UserError, match="looks like the ShapeNet part HDF5 release") as err:
            call()
        assert str(folder) in str(err.value) and "data=shapenet_part_h5" in str(err.value)


def test_modelnet_with_a_stray_val_file_is_still_modelnet(release):
    root, written = release
    folder = root / HDF5_FOLDER
    rewrite(folder / "ply_data_val0.h5", data=points(), label=labels())
    dm = ModelNet40(root=str(root), npoints=16)  # shape_names.txt says ModelNet40: the globs decide, as before
    dm.setup()
    assert len(dm.train_set) == len(written["train"][1])


def test_truncated_file(release):
    root, _ = release
    path = root / HDF5_FOLDER / "ply_data_test0.h5"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(UserError, match="truncated or corrupt") as err:
        ModelNet40(root=str(root), npoints=16).setup()
    assert str(path) in str(err.value)


def test_garbage_file(release):
    root, _ = release
    path = root / HDF5_FOLDER / "ply_data_train0.h5"
    path.write_bytes(b"not hdf5 at all")
    with pytest.raises(UserError, match="ply_data_train0.h5 cannot be read as HDF5"):
        ModelNet40(root=str(root), npoints=16).setup()


@pytest.mark.parametrize(
    "kwargs", [dict(npoints=0), dict(batch_size=0), dict(val_fraction=1.0), dict(num_workers=-1), dict(seed=-1)]
)
def test_bad_options(tmp_path, kwargs):
    with pytest.raises(UserError, match=next(iter(kwargs))):
        ModelNet40(root=str(tmp_path), **kwargs)


# ---------------------------------------------------------------------------
# ModelNet40PyG: a handful of OFF meshes, processed offline by torch-geometric.

TETRAHEDRON = "OFF\n4 4 0\n1 1 1\n1 -1 -1\n-1 1 -1\n-1 -1 1\n3 0 1 2\n3 0 1 3\n3 0 2 3\n3 1 2 3\n"
CUBE = (
    "OFF\n8 6 0\n"
    + "".join(f"{x} {y} {z}\n" for x in (-1, 1) for y in (-1, 1) for z in (-1, 1))
    + "4 0 1 3 2\n4 4 6 7 5\n4 0 4 5 1\n4 2 3 7 6\n4 0 2 6 4\n4 1 5 7 3\n"
)
OCTAHEDRON = (
    "OFF\n6 8 0\n1 0 0\n-1 0 0\n0 1 0\n0 -1 0\n0 0 1\n0 0 -1\n"
    "3 0 2 4\n3 2 1 4\n3 1 3 4\n3 3 0 4\n3 2 0 5\n3 1 2 5\n3 3 1 5\n3 0 3 5\n"
)
MESHES = {"airplane": TETRAHEDRON, "bathtub": CUBE, "bed": OCTAHEDRON}  # labels 0, 1, 2


@pytest.fixture
def pyg_root(tmp_path):
    raw = tmp_path / "raw"
    for category in MODELNET40_CLASSES:
        (raw / category).mkdir(parents=True)
    for category, off in MESHES.items():
        for split, count in (("train", 2), ("test", 1)):
            (raw / category / split).mkdir()
            for i in range(count):
                (raw / category / split / f"{category}_{i + 1:04d}.off").write_text(off)
    return tmp_path


def test_pyg_processes_offline_and_follows_the_batch_contract(pyg_root):
    dm = ModelNet40PyG(root=str(pyg_root), npoints=128, batch_size=4, augment=False)
    assert dm.num_classes == 40 and dm.class_names == MODELNET40_CLASSES
    dm.prepare_data()
    assert (pyg_root / "processed" / "training.pt").is_file()
    dm.setup()
    assert len(dm.train_set) == 6 and len(dm.test_set) == 3
    assert sorted(dm.train_set.labels.tolist()) == [0, 0, 1, 1, 2, 2]

    test = list(dm.test_dataloader())
    assert len(test) == 1
    pts, lab = test[0]["points"], test[0]["label"]
    assert pts.shape == (3, 128, 3) and pts.dtype == torch.float32 and lab.dtype == torch.int64
    # Each cloud centred and scaled to the unit sphere, as the HDF5 release's are.
    assert torch.allclose(pts.mean(dim=1), torch.zeros(3, 3), atol=1e-6)
    assert torch.allclose(pts.norm(dim=2).amax(dim=1), torch.ones(3), atol=1e-6)
    source = dm.test_set.source
    for i in range(3):  # sampled on the right surface: PyG's cloud in mesh units, the same draw (seed) as the sample
        torch.manual_seed(draw_seed((dm.seed, SPLITS["test"]), i))
        cloud, label = source.dataset[int(source.index[i])].pos, int(source.labels[i])
        assert np.allclose(dm.test_set[i]["points"], unit_sphere(cloud.double().numpy(), [0, 128]), atol=1e-6)
        if label == 1:  # cube: one coordinate at +-1
            assert torch.allclose(cloud.abs().max(dim=1).values, torch.ones(128), atol=1e-5)
        elif label == 2:  # octahedron: |x| + |y| + |z| = 1
            assert torch.allclose(cloud.abs().sum(dim=1), torch.ones(128), atol=1e-5)
        else:  # tetrahedron: on one of its face planes s . p = 1, s in {(-1,-1,-1), (1,1,-1), (1,-1,1), (-1,1,1)}
            signs = torch.tensor([[-1.0, -1, -1], [1, 1, -1], [1, -1, 1], [-1, 1, 1]])
            residual = (cloud @ signs.T - 1).abs().min(dim=1).values
            assert residual.max() < 1e-5
    train = next(iter(dm.train_dataloader()))
    assert train["points"].shape == (4, 128, 3) and train["label"].shape == (4,)


@pytest.mark.parametrize("val_fraction", [0.0, 0.5])
def test_pyg_evaluation_clouds_are_the_same_on_every_pass(pyg_root, val_fraction):
    """The test clouds (and a val_fraction's) were sampled on the meshes from torch's global generator: every
    validation scored other points, two processes (each seeded apart) other points than one, and `mode=test` other
    points than its run's test. Now each is drawn from (seed, split, index): the same whatever the global
    generator, other for another shape or seed; training clouds stay new on every access."""
    def clouds(dm, split, seed):
        torch.manual_seed(seed)
        return next(iter(getattr(dm, f"{split}_dataloader")()))["points"]

    dm = ModelNet40PyG(root=str(pyg_root), npoints=64, eval_batch_size=3, augment=False, val_fraction=val_fraction)
    dm.setup()
    for split in ("test", "val"):
        first = clouds(dm, split, 0)
        assert torch.equal(first, clouds(dm, split, 1)), split
        assert not torch.equal(first[0], first[1])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    dm.test_set[0]
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was
    other = ModelNet40PyG(root=str(pyg_root), npoints=64, eval_batch_size=3, augment=False, seed=1,
                          val_fraction=val_fraction)
    other.setup()
    assert not torch.equal(clouds(other, "test", 0), clouds(dm, "test", 0))
    train = dm.train_set
    assert not torch.equal(train[0]["points"], train[0]["points"])


def test_pyg_augments_train_only(pyg_root):
    dm = ModelNet40PyG(root=str(pyg_root), npoints=64)
    dm.setup()
    cube = [i for i in range(6) if dm.train_set.labels[i] == 1][0]
    unit = lambda p: bool(p.mean(dim=0).abs().max() < 1e-6 and abs(p.norm(dim=1).max() - 1) < 1e-6)  # noqa: E731
    assert not unit(dm.train_set[cube]["points"])  # scaled and shifted after the unit-sphere normalisation
    test_cube = [i for i in range(3) if dm.test_set.labels[i] == 1][0]
    assert unit(dm.test_set[test_cube]["points"])


def test_pyg_missing_raw(tmp_path):
    with pytest.raises(UserError) as err:
        ModelNet40PyG(root=str(tmp_path)).prepare_data()
    assert str(tmp_path / "raw") in str(err.value) and "data=shapes" in str(err.value)
    assert not (tmp_path / "processed").exists()


def test_pyg_missing_or_extra_category(pyg_root):
    (pyg_root / "raw" / "xbox").rmdir()
    (pyg_root / "raw" / "__MACOSX").mkdir()
    with pytest.raises(UserError, match=r"missing: \['xbox'\], unexpected: \['__MACOSX'\]"):
        ModelNet40PyG(root=str(pyg_root)).setup()


def test_pyg_malformed_mesh(pyg_root):
    (pyg_root / "raw" / "bed" / "train" / "bed_0001.off").write_text("OFF\nthree four\n")
    with pytest.raises(UserError, match="could not process the ModelNet40 meshes"):
        ModelNet40PyG(root=str(pyg_root)).prepare_data()


# ---------------------------------------------------------------------------
# on_bad_file: fault injection


def test_truncated_h5_fault_injection(tmp_path, modelnet_release):
    """A half-copied file: named in the error; with skip, named in ``skipped`` and every other file's samples kept."""
    root = tmp_path / HDF5_FOLDER
    written = modelnet_release(root, train_sizes=(5, 4, 3), test_sizes=(6,))
    path = root / "ply_data_train1.h5"
    copy = (root / "ply_data_train0.h5").read_bytes()  # a valid file, cut in half
    path.write_bytes(copy[: len(copy) // 2])
    with pytest.raises(UserError, match="cannot be read as HDF5") as err:
        ModelNet40(root=str(tmp_path), npoints=16).setup()
    assert str(path) in str(err.value) and "on_bad_file=skip" in str(err.value)
    dm = ModelNet40(root=str(tmp_path), npoints=16, on_bad_file="skip", augment=False)
    dm.setup()
    assert len(dm.skipped) == 1 and dm.skipped[0].startswith(f"{path}: unreadable")
    points, labels = written["train"]
    kept = np.r_[0:5, 9:12]  # files 0 and 2
    assert len(dm.train_set) == 8 and dm.train_set.labels.tolist() == labels[kept].tolist()
    np.testing.assert_array_equal(dm.train_set[5]["points"].numpy(), points[9, :16])
    assert len(dm.test_set) == 6


def test_skip_drops_bad_samples_only(release):
    root, written = release
    path = root / HDF5_FOLDER / "ply_data_train1.h5"
    data = np.zeros((4, 64, 3), np.float32)
    data[1, 3, 0] = np.nan
    rewrite(path, data=data, label=np.array([[0], [1], [45], [3]], np.uint8))
    dm = ModelNet40(root=str(root), npoints=16, on_bad_file="skip")
    dm.setup()
    assert dm.skipped == [f"{path}[2]: sample 2 has label 45, expected 0..39",
                          f"{path}[1]: sample 1 has NaN or infinite coordinates"]  # fmt: skip
    assert len(dm.train_set) == len(written["train"][1]) - 4 + 2
    assert ModelNet40(root=str(root), npoints=16).skipped == []  # before setup, and with nothing to skip


def test_skip_with_nothing_left_is_an_error(release):
    root, _ = release
    for path in (root / HDF5_FOLDER).glob("ply_data_train*.h5"):
        path.write_bytes(b"junk")
    with pytest.raises(UserError, match=r"nothing left to train or test on, all 2 bad file"):
        ModelNet40(root=str(root), npoints=16, on_bad_file="skip").setup()


def test_on_bad_file_is_checked(tmp_path):
    with pytest.raises(UserError, match="data.on_bad_file must be 'error'"):
        ModelNet40(root=str(tmp_path), on_bad_file="ignore")


def test_pyg_unsampleable_mesh_skipped(pyg_root):
    path = pyg_root / "raw" / "bed" / "train" / "bed_0002.off"
    path.write_text("OFF\n3 1 0\n0 0 0\n1 1 1\n2 2 2\n3 0 1 2\n")  # replaced by a degenerate triangle: zero area
    with pytest.raises(UserError, match=r"bed_0002\.off: zero surface area"):
        ModelNet40PyG(root=str(pyg_root)).setup()
    dm = ModelNet40PyG(root=str(pyg_root), on_bad_file="skip")
    dm.setup()
    assert len(dm.skipped) == 1 and len(dm.train_set) == 5
    assert all(torch.isfinite(dm.train_set[i]["points"]).all() for i in range(5))
