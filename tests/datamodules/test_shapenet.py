"""ShapeNetPart (txt), ShapeNetPartH5 and ShapeNetPartPyG on tiny releases in the official layouts."""

import hashlib
import json
import logging
import os
import zipfile

import h5py
import lightning as L
import numpy as np
import pytest
import torch

from attention.errors import UserError
from datamodules import ShapeNetPart, ShapeNetPartH5, ShapeNetPartPyG
from datamodules.partseg.base import sample_indices
from datamodules.partseg.shapenet import CATEGORY_NAMES, CATEGORY_PARTS, H5_FOLDER, TXT_FOLDER
from datamodules.points.ops import sample_rng, scale_shift

EXPECTED_PARTS = {
    "Airplane": (0, 3), "Bag": (4, 5), "Cap": (6, 7), "Car": (8, 11), "Chair": (12, 15), "Earphone": (16, 18),
    "Guitar": (19, 21), "Knife": (22, 23), "Lamp": (24, 27), "Laptop": (28, 29), "Motorbike": (30, 35),
    "Mug": (36, 37), "Pistol": (38, 40), "Rocket": (41, 43), "Skateboard": (44, 46), "Table": (47, 49),
}  # fmt: skip


def normalised(values):
    """The reference pc_normalize of a written shape: centroid at 0, farthest point at 1."""
    xyz = values[:, :3] - values[:, :3].mean(axis=0)
    return xyz / np.linalg.norm(xyz, axis=1).max()


def match_rows(got, expected, atol=1e-5):
    """Index into ``expected`` (P, 3) of every row of ``got`` (N, 3); asserts every row is found."""
    dist = np.linalg.norm(got[:, None, :] - expected[None, :, :], axis=-1)  # (N, P)
    idx = dist.argmin(axis=1)
    assert dist[np.arange(len(got)), idx].max() <= atol
    return idx


@pytest.mark.parametrize("cls", [ShapeNetPart, ShapeNetPartH5, ShapeNetPartPyG])
def test_categories_and_parts_need_no_disk(tmp_path, cls):
    dm = cls(root=str(tmp_path / "nowhere"))
    assert dm.num_categories == 16 and dm.num_parts == 50
    assert dm.category_names == CATEGORY_NAMES == list(EXPECTED_PARTS)
    assert dm.category_names == sorted(dm.category_names)
    assert [(p[0], p[-1]) for p in dm.category_parts] == list(EXPECTED_PARTS.values())
    assert sum(dm.category_parts, []) == list(range(50))
    assert dm.npoints == 2048 and dm.batch_size == 16 and not dm.normals
    assert not (tmp_path / "nowhere").exists()


def test_sample_indices():
    rng = np.random.default_rng(0)
    idx = sample_indices(100, 30, rng)
    assert len(set(idx.tolist())) == 30 and idx.max() < 100  # without replacement
    idx = sample_indices(10, 25, rng)
    assert sorted(set(idx.tolist())) == list(range(10)) and len(idx) == 25  # every point, then repeats


# ---------------------------------------------------------------------------
# ShapeNetPart: the txt release.


@pytest.fixture
def txt(tmp_path, shapenet_txt_release):
    """A valid txt release under tmp_path/TXT_FOLDER; returns (root, written)."""
    return tmp_path, shapenet_txt_release(tmp_path / TXT_FOLDER)


def test_txt_loads_what_was_written(txt):
    root, written = txt
    dm = ShapeNetPart(root=str(root), npoints=16, normals=True, batch_size=2, eval_batch_size=2)
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4, 2, 3)
    for dataset, split in ((dm.train_set, "train"), (dm.val_set, "val"), (dm.test_set, "test")):
        assert dataset.categories.tolist() == [c for _, c, _ in written[split]]
    batches = list(dm.test_dataloader())
    assert [len(b["category"]) for b in batches] == [2, 1]  # nothing dropped or duplicated
    batch = batches[0]
    assert set(batch) == {"points", "parts", "category", "normals", "index"}
    assert torch.cat([b["index"] for b in batches]).tolist() == [0, 1, 2]  # which shape: the votes' key
    assert batch["points"].shape == (2, 16, 3) and batch["points"].dtype == torch.float32
    assert batch["parts"].shape == (2, 16) and batch["parts"].dtype == torch.int64
    assert batch["category"].shape == (2,) and batch["category"].dtype == torch.int64
    assert batch["normals"].shape == (2, 16, 3) and batch["normals"].dtype == torch.float32
    for i, (path, category, values) in enumerate(written["test"]):  # 20..40 points >= 16: a subset
        sample = dm.test_set[i]
        assert sample["category"].item() == category
        rows = match_rows(sample["points"].numpy(), normalised(values))
        assert len(set(rows.tolist())) == 16  # no repeats
        np.testing.assert_array_equal(sample["parts"].numpy(), values[rows, 6])
        np.testing.assert_allclose(sample["normals"].numpy(), values[rows, 3:6], atol=1e-6)
        lo, hi = EXPECTED_PARTS[CATEGORY_NAMES[category]]
        assert lo <= sample["parts"].min() and sample["parts"].max() <= hi


def test_txt_points_are_normalised_before_sampling_and_small_shapes_are_padded(txt):
    root, written = txt
    dm = ShapeNetPart(root=str(root), npoints=64)  # more than any shape has (<= 40)
    dm.setup()
    for i, (_, _, values) in enumerate(written["val"]):
        sample = dm.val_set[i]
        assert "normals" not in sample and sample["points"].shape == (64, 3)
        rows = match_rows(sample["points"].numpy(), normalised(values))
        assert sorted(set(rows.tolist())) == list(range(len(values)))  # every point at least once
        np.testing.assert_array_equal(sample["parts"].numpy(), values[rows, 6])
        # the stored shape itself is on the unit sphere, centred
        points, _, _ = dm.val_set.source.shape(i)
        np.testing.assert_allclose(points.mean(axis=0), 0, atol=1e-6)
        assert abs(np.linalg.norm(points, axis=1).max() - 1) < 1e-6


def test_eval_is_deterministic_and_train_is_random_per_epoch(txt):
    root, _ = txt
    make = lambda seed=0: ShapeNetPart(root=str(root), npoints=8, batch_size=2, seed=seed)  # noqa: E731
    a, b = make(), make()
    first = [x["points"] for x in a.val_dataloader()]
    again = [x["points"] for x in a.val_dataloader()]
    other = [x["points"] for x in b.val_dataloader()]
    for x, y, z in zip(first, again, other):
        assert torch.equal(x, y) and torch.equal(x, z)
    c = make(seed=1)
    c.setup()
    assert not torch.equal(c.val_set[0]["points"], a.val_set[0]["points"])
    L.seed_everything(0)
    epoch1 = [x["points"] for x in a.train_dataloader()]
    epoch2 = [x["points"] for x in a.train_dataloader()]
    assert len(epoch1) == 2  # 4 shapes, batch 2
    assert not torch.equal(epoch1[0], epoch2[0])
    L.seed_everything(0)
    replay = [x["points"] for x in b.train_dataloader()]
    assert all(torch.equal(x, y) for x, y in zip(epoch1, replay))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_train_augmentation_is_scale_shift_on_the_selected_points(txt, num_workers):
    root, _ = txt
    dm = ShapeNetPart(root=str(root), npoints=16, normals=True, num_workers=num_workers)
    dm.setup()
    for i in range(len(dm.train_set)):
        torch.manual_seed(100 + i)
        sample = dm.train_set[i]
        torch.manual_seed(100 + i)  # replay the documented draws
        rng = sample_rng()
        points, parts, normals = dm.train_set.source.shape(i)
        choice = sample_indices(len(points), 16, rng)
        np.testing.assert_allclose(sample["points"].numpy(), scale_shift(points[choice], rng), rtol=1e-6)
        np.testing.assert_array_equal(sample["parts"].numpy(), parts[choice])
        np.testing.assert_array_equal(sample["normals"].numpy(), normals[choice])  # unchanged
    assert len(next(iter(dm.train_dataloader()))["category"]) == 4


def test_trainval_trains_on_train_and_val_and_validates_on_test(txt):
    root, written = txt
    dm = ShapeNetPart(root=str(root), npoints=8, trainval=True, batch_size=64)
    dm.setup()
    assert len(dm.train_set) == 6 and dm.val_set is dm.test_set
    cats = [c for _, c, _ in written["train"] + written["val"]]
    assert dm.train_set.categories.tolist() == cats
    assert [len(b["category"]) for b in dm.train_dataloader()] == [6]  # a single small batch is kept


def test_root_may_be_the_release_folder(txt):
    root, written = txt
    dm = ShapeNetPart(root=str(root / TXT_FOLDER), npoints=16)
    dm.setup()
    _, category, values = written["test"][1]
    assert dm.test_set[1]["category"].item() == category
    match_rows(dm.test_set[1]["points"].numpy(), normalised(values))


def test_cache_is_reused_and_rebuilt_when_files_change(txt, monkeypatch):
    import datamodules.partseg.shapenet_part as shapenet_part

    root, written = txt
    ShapeNetPart(root=str(root)).prepare_data()
    caches = sorted(p.name for p in (root / "processed").iterdir())
    assert caches == ["shapenet_part_test.npz", "shapenet_part_train.npz", "shapenet_part_val.npz"]

    calls = []
    original = shapenet_part.read_shape_txt
    monkeypatch.setattr(shapenet_part, "read_shape_txt", lambda *a: calls.append(a[0]) or original(*a))
    dm = ShapeNetPart(root=str(root), npoints=8)
    dm.setup()
    assert calls == []  # all three splits from the cache

    path, category, values = written["val"][0]
    values = values.copy()
    values[:, :3] *= 2.0
    values[:, 3] = 0.5
    np.savetxt(path, values, fmt="%.6f")
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    dm = ShapeNetPart(root=str(root), npoints=8, normals=True)
    dm.setup()
    assert len(calls) == 2 and set(calls) == {p for p, _, _ in written["val"]}  # only the val split
    assert (dm.val_set[0]["normals"][:, 0] == 0.5).all()

    listing = root / TXT_FOLDER / "train_test_split" / "shuffled_test_file_list.json"
    entries = json.loads(listing.read_text())
    listing.write_text(json.dumps(entries[:2]))
    calls.clear()
    dm = ShapeNetPart(root=str(root), npoints=8)
    dm.setup()
    assert len(dm.test_set) == 2 and len(calls) == 2


def test_unwritable_data_folder_keeps_its_cache_in_the_users_cache_folder(txt, unwritable, monkeypatch, caplog):
    """A shared data set the user may not write ended the run with a bare PermissionError (exit code 1)."""
    import datamodules.partseg.shapenet_part as shapenet_part

    root, _ = txt
    user_cache = unwritable(root)
    with caplog.at_level(logging.WARNING):
        ShapeNetPart(root=str(root)).prepare_data()
    assert caplog.text.count("cannot be written") == 1 and str(root / "processed") in caplog.text  # once, 3 splits
    assert not list(root.rglob("*.npz"))
    assert sorted(p.name for p in user_cache.rglob("*.npz")) == [f"shapenet_part_{s}.npz" for s in ("test", "train",
                                                                                                    "val")]
    calls = []
    original = shapenet_part.read_shape_txt
    monkeypatch.setattr(shapenet_part, "read_shape_txt", lambda *a: calls.append(a[0]) or original(*a))
    dm = ShapeNetPart(root=str(root), npoints=8)
    dm.setup()
    assert calls == [] and len(dm.train_set) == 4  # read from the user's cache folder

    unwritable(user_cache)  # that one too, and a file changed: the run parses again, goes on without a cache
    os.utime(next((root / TXT_FOLDER).glob("*/*.txt")), ns=(1, 1))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dm = ShapeNetPart(root=str(root), npoints=8)
        dm.setup()
    assert calls and "going on without it" in caplog.text and len(dm.train_set) == 4


def test_corrupt_cache_is_rebuilt(txt):
    root, _ = txt
    ShapeNetPart(root=str(root)).prepare_data()
    (root / "processed" / "shapenet_part_train.npz").write_bytes(b"garbage")
    dm = ShapeNetPart(root=str(root), npoints=8)
    dm.setup()
    assert len(dm.train_set) == 4


def test_missing_release_says_how_to_get_it(tmp_path):
    dm = ShapeNetPart(root=str(tmp_path / "nowhere"))
    for call in (dm.prepare_data, dm.setup):
        with pytest.raises(UserError) as err:
            call()
        message = str(err.value)
        assert str(tmp_path / "nowhere" / TXT_FOLDER) in message
        assert "data.download=true" in message and "data=parts" in message
        assert "synsetoffset2category.txt" in message and "shuffled_{train,val,test}_file_list.json" in message


@pytest.mark.parametrize("missing", ["synsetoffset2category.txt", "train_test_split/shuffled_val_file_list.json"])
def test_missing_index_file(txt, missing):
    root, _ = txt
    os.remove(root / TXT_FOLDER / missing)
    with pytest.raises(UserError, match="data=parts") as err:
        ShapeNetPart(root=str(root)).setup()
    assert str(root / TXT_FOLDER / missing) in str(err.value)


def _rewrite_line(path, number, text):
    lines = path.read_text().splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


BAD_ROWS = {
    "six numbers": ("0.1 0.2 0.3 0 0 1", "line 3: expected 7 numbers"),
    "eight numbers": ("0.1 0.2 0.3 0 0 1 0 0", "line 3: expected 7 numbers"),
    "not a number": ("0.1 abc 0.3 0 0 1 0", "line 3: expected 7 numbers"),
    "nan": ("0.1 nan 0.3 0 0 1 {part}", "line 3: NaN or infinite"),
    "inf": ("0.1 0.2 -inf 0 0 1 {part}", "line 3: NaN or infinite"),
    "part of another category": ("0.1 0.2 0.3 0 0 1 {other}", "line 3: part label {other} is outside the {name} range"),
    "fractional part": ("0.1 0.2 0.3 0 0 1 {part}.5", "line 3: part label {part}.5 is outside"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_names_file_and_line(txt, case):
    root, written = txt
    path, category, _ = written["val"][1]
    lo, hi = EXPECTED_PARTS[CATEGORY_NAMES[category]]
    fmt = dict(part=lo, other=hi + 1, name=CATEGORY_NAMES[category])
    row, expected = (s.format(**fmt) for s in BAD_ROWS[case])
    _rewrite_line(path, 3, row)
    with pytest.raises(UserError) as err:
        ShapeNetPart(root=str(root)).prepare_data()
    message = str(err.value)
    assert f"{path}, {expected}" in message, message
    if case == "part of another category":
        assert f"range {lo}..{hi}" in message


def test_blank_lines_are_skipped_but_counted(txt):
    root, written = txt
    path, category, values = written["test"][0]
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + [""] + lines[2:4] + ["0 0 0 0 0 1 99"] + lines[4:]) + "\n")
    with pytest.raises(UserError, match=r", line 6: part label 99 is outside"):
        ShapeNetPart(root=str(root)).setup()
    path.write_text("\n".join(lines[:2] + ["", "   "] + lines[2:]) + "\n")
    dm = ShapeNetPart(root=str(root), npoints=len(values))
    dm.setup()
    assert len(dm.test_set.source.shape(0)[0]) == len(values)


def _edit_listing(root, split, edit):
    path = root / TXT_FOLDER / "train_test_split" / f"shuffled_{split}_file_list.json"
    entries = json.loads(path.read_text())
    path.write_text(json.dumps(edit(entries)))
    return path


def test_unknown_synset_in_split_list(txt):
    root, _ = txt
    listing = _edit_listing(root, "test", lambda e: e[:1] + ["shape_data/99999999/abc"] + e[1:])
    with pytest.raises(UserError) as err:
        ShapeNetPart(root=str(root)).setup()
    assert f"{listing}: entry 1 'shape_data/99999999/abc'" in str(err.value)
    assert "category id outside 0-15" in str(err.value)


def test_missing_shape_file(txt):
    root, written = txt
    path = written["train"][2][0]
    os.remove(path)
    entry = f"shape_data/{path.parent.name}/{path.stem}"
    listing = root / TXT_FOLDER / "train_test_split" / "shuffled_train_file_list.json"
    index = json.loads(listing.read_text()).index(entry)
    with pytest.raises(UserError) as err:
        ShapeNetPart(root=str(root)).prepare_data()
    assert f"{listing}: entry {index} '{entry}' refers to {path}, which does not exist" in str(err.value)


@pytest.mark.parametrize("bad", [["shape_data/02691156"], [3], ["02691156/abc"]])
def test_malformed_split_entry(txt, bad):
    root, _ = txt
    listing = _edit_listing(root, "val", lambda e: e + bad)
    with pytest.raises(UserError, match=r"entry 2 is .* expected 'shape_data/<synset>/<id>'") as err:
        ShapeNetPart(root=str(root)).setup()
    assert str(listing) in str(err.value)


def test_invalid_json(txt):
    root, _ = txt
    listing = root / TXT_FOLDER / "train_test_split" / "shuffled_test_file_list.json"
    listing.write_text('[\n"shape_data/02691156/x",\n')
    with pytest.raises(UserError, match=r"shuffled_test_file_list.json, line 3: not valid JSON"):
        ShapeNetPart(root=str(root)).setup()


def test_bad_synsetoffset_line(txt):
    root, _ = txt
    path = root / TXT_FOLDER / "synsetoffset2category.txt"
    _rewrite_line(path, 5, "Chair 0300162")
    with pytest.raises(UserError, match=r"synsetoffset2category.txt, line 5: expected") as err:
        ShapeNetPart(root=str(root)).setup()
    assert str(path) in str(err.value) and "'Chair 0300162'" in str(err.value)


def test_txt_download_then_load(tmp_path, http_folder, shapenet_txt_release):
    served, base = http_folder
    source = tmp_path / "source"
    written = shapenet_txt_release(source / TXT_FOLDER, counts={"train": 2, "val": 1, "test": 1})
    archive = served / f"{TXT_FOLDER}.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted((source / TXT_FOLDER).rglob("*")):
            zf.write(path, str(path.relative_to(source)))
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    root = tmp_path / "data"
    url = f"{base}/{TXT_FOLDER}.zip"
    with pytest.raises(UserError, match="Checksum mismatch"):
        ShapeNetPart(root=str(root), download=True, url=url, md5="0" * 32).prepare_data()
    dm = ShapeNetPart(root=str(root), npoints=8, download=True, url=url, md5=digest)
    dm.prepare_data()
    dm.setup()
    assert (root / TXT_FOLDER / "synsetoffset2category.txt").is_file()
    assert (root / "processed" / "shapenet_part_train.npz").is_file()
    assert dm.test_set[0]["category"].item() == written["test"][0][1]


# ---------------------------------------------------------------------------
# ShapeNetPartH5: the HDF5 release.


@pytest.fixture
def h5(tmp_path, shapenet_h5_release):
    return tmp_path, shapenet_h5_release(tmp_path / H5_FOLDER)


def test_h5_loads_what_was_written(h5):
    root, written = h5
    dm = ShapeNetPartH5(root=str(root), npoints=2048, batch_size=3, eval_batch_size=3)
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (5, 2, 4)
    data, label, pid = written["test"]
    batches = list(dm.test_dataloader())
    assert [len(b["category"]) for b in batches] == [3, 1]
    assert set(batches[0]) == {"points", "parts", "category", "index"}
    for i in range(4):
        sample = dm.test_set[i]
        assert sample["category"].item() == label[i]
        rows = match_rows(sample["points"].numpy(), data[i], atol=0)
        assert sorted(rows.tolist()) == list(range(2048))  # npoints == 2048: a permutation
        np.testing.assert_array_equal(sample["parts"].numpy(), pid[i, rows])
    plain = ShapeNetPartH5(root=str(root), npoints=100, augment=False)
    plain.setup()
    data, label, pid = written["train"]  # ply_data_train0 then ply_data_train1
    for i in range(5):
        sample = plain.train_set[i]
        rows = match_rows(sample["points"].numpy(), data[i], atol=0)
        assert len(set(rows.tolist())) == 100
        np.testing.assert_array_equal(sample["parts"].numpy(), pid[i, rows])
        assert sample["category"].item() == label[i]


def test_h5_files_in_natural_order_and_trainval(tmp_path, shapenet_h5_release):
    written = shapenet_h5_release(tmp_path, sizes={"train": (1,) * 11, "val": (1,), "test": (1,)}, points=32)
    dm = ShapeNetPartH5(root=str(tmp_path), npoints=32, trainval=True)  # root is the release folder itself
    dm.setup()
    assert len(dm.train_set) == 12 and dm.val_set is dm.test_set
    for i in range(12):  # train0, train1, ..., train10, then val0
        data = written["train"][0][i] if i < 11 else written["val"][0][0]
        match_rows(dm.train_set.source.shape(i)[0], data, atol=0)
        assert np.array_equal(np.sort(dm.train_set.source.shape(i)[0], axis=0), np.sort(data, axis=0))


def test_h5_has_no_normals(tmp_path):
    with pytest.raises(UserError, match="stores no normals") as err:
        ShapeNetPartH5(root=str(tmp_path), normals=True)
    assert "data=shapenet_part" in str(err.value)


def test_h5_missing_folder_and_split(tmp_path, shapenet_h5_release):
    with pytest.raises(UserError) as err:
        ShapeNetPartH5(root=str(tmp_path)).prepare_data()
    message = str(err.value)
    assert str(tmp_path / H5_FOLDER) in message and "data.download=true" in message and "data=parts" in message
    shapenet_h5_release(tmp_path / H5_FOLDER, sizes={"train": (1,), "test": (1,)}, points=8)
    with pytest.raises(UserError, match="has no ply_data_val"):
        ShapeNetPartH5(root=str(tmp_path)).setup()


def _h5(n=4, p=16, **override):
    arrays = dict(data=np.zeros((n, p, 3), np.float32), label=np.zeros((n, 1), np.uint8),
                  pid=np.zeros((n, p), np.uint8))  # fmt: skip
    arrays.update(override)
    return {k: v for k, v in arrays.items() if v is not None}


def _with(key, index, value, dtype=None):
    arrays = _h5()
    arrays[key] = arrays[key].astype(dtype or arrays[key].dtype)
    arrays[key][index] = value
    return arrays


BAD_H5 = {
    "missing data": (_h5(data=None), "no 'data' dataset"),
    "missing label": (_h5(label=None), "no 'label' dataset"),
    "missing pid": (_h5(pid=None), "no 'pid' dataset"),
    "data not 3-D": (_h5(data=np.zeros((4, 16), np.float32)), "'data' has shape (4, 16), expected (n, points, 3)"),
    "data 6 channels": (_h5(data=np.zeros((4, 16, 6), np.float32)), "expected (n, points, 3)"),
    "integer data": (_h5(data=np.zeros((4, 16, 3), np.int32)), "'data' has dtype int32, expected floating point"),
    "float pid": (_h5(pid=np.zeros((4, 16), np.float32)), "'pid' has dtype float32, expected integer"),
    "label shape": (_h5(label=np.zeros((4, 2), np.uint8)), "'label' has shape (4, 2), expected (n, 1) or (n,)"),
    "label count": (_h5(label=np.zeros((3, 1), np.uint8)), "'data' has n=4 but 'label' has n=3"),
    "pid points": (_h5(pid=np.zeros((4, 15), np.uint8)), "'data' has points=16 but 'pid' has points=15"),
    "category 16": (_with("label", (2, 0), 16), "sample 2 has category label 16, expected 0..15"),
    "category -1": (_with("label", (1, 0), -1, np.int64), "sample 1 has category label -1"),
    "part of another category": (_with("pid", (3, 7), 4),
                                 "sample 3, point 7 has part label 4, outside the Airplane range 0..3"),
    "nan": (_with("data", (2, 5, 1), np.nan), "sample 2, point 5 has NaN or infinite"),
    "inf": (_with("data", (0, 9, 2), np.inf), "sample 0, point 9 has NaN or infinite"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_H5))
def test_h5_bad_file_names_file_and_sample(h5, case):
    root, _ = h5
    path = root / H5_FOLDER / "ply_data_train1.h5"
    arrays, expected = BAD_H5[case]
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f[key] = value
    with pytest.raises(UserError) as err:
        ShapeNetPartH5(root=str(root), npoints=16).setup()
    assert f"{path}" in str(err.value) and expected in str(err.value), str(err.value)


def test_h5_truncated_file(h5):
    root, _ = h5
    path = root / H5_FOLDER / "ply_data_val0.h5"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(UserError, match="truncated or corrupt") as err:
        ShapeNetPartH5(root=str(root)).setup()
    assert str(path) in str(err.value)


def test_h5_download_then_load(tmp_path, http_folder, shapenet_h5_release):
    served, base = http_folder
    written = shapenet_h5_release(tmp_path / "source", points=64)
    archive = served / f"{H5_FOLDER}.zip"
    with zipfile.ZipFile(archive, "w") as zf:  # the official zip holds hdf5_data/ply_data_*.h5
        for path in sorted((tmp_path / "source").iterdir()):
            zf.write(path, f"hdf5_data/{path.name}")
    root = tmp_path / "data"
    dm = ShapeNetPartH5(root=str(root), npoints=64, download=True, url=f"{base}/{H5_FOLDER}.zip",
                        md5=hashlib.md5(archive.read_bytes()).hexdigest())  # fmt: skip
    dm.prepare_data()
    dm.setup()
    assert dm.val_set[1]["category"].item() == written["val"][1][1]


# ---------------------------------------------------------------------------
# ShapeNetPartPyG: torch_geometric.datasets.ShapeNet on <root>/raw.


@pytest.fixture
def pyg(tmp_path, shapenet_txt_release, monkeypatch):
    """The txt release written as <root>/raw; any download attempt fails the test."""
    import torch_geometric.datasets.shapenet as pyg_shapenet

    def no_download(*args, **kwargs):
        raise AssertionError("PyG tried to download")

    monkeypatch.setattr(pyg_shapenet, "download_url", no_download)
    return tmp_path, shapenet_txt_release(tmp_path / "raw")


def test_pyg_processes_offline_and_follows_the_contract(pyg):
    root, written = pyg
    dm = ShapeNetPartPyG(root=str(root), npoints=16, normals=True, batch_size=2)
    dm.prepare_data()
    assert any((root / "processed").glob("*_train.pt"))
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4, 2, 3)
    for dataset, split in ((dm.train_set, "train"), (dm.val_set, "val"), (dm.test_set, "test")):
        assert dataset.categories.tolist() == [c for _, c, _ in written[split]]
    for i, (_, category, values) in enumerate(written["test"]):
        sample = dm.test_set[i]
        assert sample["category"].item() == category
        rows = match_rows(sample["points"].numpy(), normalised(values))
        assert len(set(rows.tolist())) == 16
        np.testing.assert_array_equal(sample["parts"].numpy(), values[rows, 6])  # PyG y: global part ids
        np.testing.assert_allclose(sample["normals"].numpy(), values[rows, 3:6], atol=1e-6)
    batch = next(iter(dm.train_dataloader()))
    assert batch["points"].shape == (2, 16, 3) and batch["parts"].shape == (2, 16)
    assert batch["category"].shape == (2,) and batch["normals"].shape == (2, 16, 3)

    trainval = ShapeNetPartPyG(root=str(root), npoints=16, trainval=True)
    trainval.setup()
    assert len(trainval.train_set) == 6 and trainval.val_set is trainval.test_set
    assert "normals" not in trainval.test_set[0]


def test_pyg_missing_raw_refuses_before_download(pyg):
    root, _ = pyg
    with pytest.raises(UserError) as err:
        ShapeNetPartPyG(root=str(root / "elsewhere")).prepare_data()
    message = str(err.value)
    assert str(root / "elsewhere" / "raw") in message and "does not exist" in message
    assert "data=parts" in message and "data=shapenet_part" in message
    assert not (root / "elsewhere").exists()


def test_pyg_needs_every_synset_folder(pyg):
    root, _ = pyg
    os.rmdir(root / "raw" / "04379243")  # Table: empty in the fixture, but PyG checks it exists
    with pytest.raises(UserError, match="lacks 04379243"):
        ShapeNetPartPyG(root=str(root)).setup()
    assert not list(root.rglob("*.npz"))


def test_pyg_malformed_file(pyg):
    root, written = pyg
    _rewrite_line(written["val"][0][0], 2, "1 2 3")
    with pytest.raises(UserError, match="torch-geometric could not process"):
        ShapeNetPartPyG(root=str(root)).prepare_data()


def test_pyg_bad_part_label_names_the_raw_file(pyg):
    root, written = pyg
    path, category, _ = written["test"][2]
    _rewrite_line(path, 4, "0.1 0.2 0.3 0 0 1 49")
    with pytest.raises(UserError) as err:
        ShapeNetPartPyG(root=str(root)).setup()
    lo, hi = EXPECTED_PARTS[CATEGORY_NAMES[category]]
    assert f"{path}, line 4: part label 49 outside the {CATEGORY_NAMES[category]} range {lo}..{hi}" in str(err.value)


def test_category_parts_table_matches_pyg():
    from torch_geometric.datasets import ShapeNet

    assert list(ShapeNet.category_ids) == CATEGORY_NAMES
    assert list(ShapeNet.seg_classes.values()) == CATEGORY_PARTS


# ---------------------------------------------------------------------------
# on_bad_file=skip


def test_txt_skip_drops_bad_shapes_and_the_cache_remembers(txt):
    root, written = txt
    bad_shape, missing = written["train"][0][0], written["train"][1][0]
    _rewrite_line(bad_shape, 2, "1 2 nan 0 0 1 0")
    missing.unlink()
    dm = ShapeNetPart(str(root), npoints=16, on_bad_file="skip")
    dm.setup()
    assert len(dm.train_set) == len(written["train"]) - 2 and len(dm.skipped) == 2
    assert any(s.startswith(f"{missing}: missing") for s in dm.skipped)
    assert any(s.startswith(f"{bad_shape}, line 2: NaN") for s in dm.skipped)
    again = ShapeNetPart(str(root), npoints=16, on_bad_file="skip")
    again.setup()  # from the cache: the same shapes skipped and named
    assert sorted(again.skipped) == sorted(dm.skipped)
    with pytest.raises(UserError, match=r"line 2: NaN.*on_bad_file=skip|refers to .*does not exist"):
        ShapeNetPart(str(root), npoints=16).setup()


def test_h5_skip_drops_bad_files_and_samples(h5):
    root, written = h5
    folder = root / H5_FOLDER
    (folder / "ply_data_train1.h5").write_bytes(b"junk")
    arrays = _h5(n=3, p=2048)
    arrays["label"][1] = 16
    with h5py.File(folder / "ply_data_train0.h5", "w") as f:
        for key, value in arrays.items():
            f[key] = value
    dm = ShapeNetPartH5(str(root), npoints=16, on_bad_file="skip")
    dm.setup()
    assert len(dm.train_set) == 2 and len(dm.skipped) == 2
    assert dm.skipped[0] == f"{folder / 'ply_data_train0.h5'}[1]: sample 1 has category label 16, expected 0..15"
    assert dm.skipped[1].startswith(f"{folder / 'ply_data_train1.h5'}: unreadable")
