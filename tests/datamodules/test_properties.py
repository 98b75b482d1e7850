"""Property tests: every reader fed random malformed inputs either yields valid samples or raises our
UserError, never another exception (issue 9).

Each test writes a tiny release in the official layout into a fresh temporary folder per example,
replaces one file (or one part of one) by a drawn malformed version, then runs setup and reads every
sample of every split. Outcomes allowed: a UserError anywhere, or samples that keep the batch contract
(shapes, dtypes, finite values, labels in range). With ``on_bad_file=skip`` the good files' samples must
all still be there. Hypothesis is derandomised (CI-reproducible) and kept small: the whole file runs in
well under a minute on one core.
"""

from __future__ import annotations

import json
import pickle
import tempfile
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from attention.errors import UserError
from datamodules import (
    ADE20K,
    CIFAR10,
    GID,
    VOC,
    Cityscapes,
    ImageFolder,
    ModelNet40,
    ModelNet40PyG,
    ShapeNetPart,
    ShapeNetPartH5,
    ShapeNetPartPyG,
)
from datamodules.partseg.shapenet import CATEGORY_PARTS, SYNSETS
from datamodules.points.modelnet40 import MODELNET40_CLASSES
from datamodules.segmentation import GID_PALETTE, bit_colormap

pytestmark = pytest.mark.usefixtures("one_thread")


def fuzz(max_examples: int = 30):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])  # fmt: skip


@contextmanager
def folder():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


on_bad_file = st.sampled_from(["error", "skip"])

# ---------------------------------------------------------------------------
# generic strategies


@st.composite
def mangled(draw, valid: bytes) -> bytes:
    """``valid`` truncated, with bytes overwritten, replaced by random bytes, or emptied."""
    how = draw(st.sampled_from(["truncate", "flip", "random", "empty", "append"]))
    if how == "truncate":
        return valid[: draw(st.integers(0, max(len(valid) - 1, 0)))]
    if how == "flip":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "append":
        return valid + draw(st.binary(min_size=1, max_size=64))
    return b"" if how == "empty" else draw(st.binary(max_size=300))


SPECIAL = [np.nan, np.inf, -np.inf, 1e39, -3e38, 7e4, 1e300]


@st.composite
def array(draw, shapes: list, dtypes: list, lo: float, hi: float, specials=SPECIAL):
    """An array of a drawn shape and dtype, values uniform in [lo, hi] with a few special values."""
    shape = draw(st.sampled_from(shapes))
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = rng.uniform(lo, hi, shape)
    if values.size and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3))):
            values.flat[draw(st.integers(0, values.size - 1))] = draw(st.sampled_from(specials))
    if dtype.kind == "S":
        return np.full(shape, b"ab", dtype)
    with np.errstate(all="ignore"):
        return np.round(values).astype(dtype) if dtype.kind in "iub" else values.astype(dtype)


def write_h5(path: Path, datasets: dict) -> None:
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            if value is None:
                f.create_group(key)  # a group where a dataset belongs
            else:
                f[key] = value


@st.composite
def h5_file(draw, valid: dict[str, np.ndarray], fuzzed: dict[str, st.SearchStrategy]):
    """Bytes of an HDF5 file: ``valid``'s bytes mangled, or datasets drawn from ``fuzzed`` (some
    dropped, some replaced by a group, an extra one added)."""
    with folder() as tmp:
        if draw(st.booleans()):
            write_h5(tmp / "v.h5", valid)
            return draw(mangled((tmp / "v.h5").read_bytes()))
        datasets = {}
        for key, strategy in fuzzed.items():
            what = draw(st.sampled_from(["fuzzed", "fuzzed", "fuzzed", "valid", "missing", "group"]))
            if what != "missing":
                datasets[key] = draw(strategy) if what == "fuzzed" else valid[key] if what == "valid" else None
        if draw(st.booleans()):
            datasets["extra"] = np.zeros(3)
        write_h5(tmp / "f.h5", datasets)
        return (tmp / "f.h5").read_bytes()


def assert_points(points: torch.Tensor, n: int):
    assert points.dtype == torch.float32 and points.shape == (n, 3) and torch.isfinite(points).all()


# ---------------------------------------------------------------------------
# ModelNet40, HDF5 release

P, NP = 32, 16  # stored points, data.npoints
mn_valid = {"data": np.random.default_rng(0).uniform(-1, 1, (3, P, 3)).astype(np.float32),
            "label": np.array([[0], [39], [7]], np.uint8)}  # fmt: skip
mn_fuzzed = {
    "data": array([(3, P, 3), (3, P, 3), (2, P, 3), (3, 8, 3), (3, P), (3, P, 6), (0, P, 3), (3,)],
                  ["float32", "float32", "float64", "float16", "int32", "bool", "S2"], -2, 2),
    "label": array([(3, 1), (3, 1), (3,), (3, 2), (4, 1), ()], ["uint8", "int64", "int8", "uint64", "float32"], -3, 60,
                   specials=[2**40, -(2**40), 255]),
}  # fmt: skip


def check_modelnet(dm: ModelNet40 | ModelNet40PyG, good: int = 0):
    dm.setup()
    assert all(isinstance(s, str) and s for s in dm.skipped)
    for split in ("train", "val", "test"):
        dataset = getattr(dm, f"{split}_set")
        assert len(dataset) >= (good if split == "train" else 1)
        for i in range(len(dataset)):
            sample = dataset[i]
            assert_points(sample["points"], dm.npoints)
            assert sample["label"].dtype == torch.int64 and 0 <= int(sample["label"]) < 40


@fuzz(40)
@given(file=h5_file(mn_valid, mn_fuzzed), mode=on_bad_file, augment=st.booleans())
def test_modelnet40_h5(file, mode, augment):
    with folder() as root:
        write_h5(root / "ply_data_train0.h5", mn_valid)
        (root / "ply_data_train1.h5").write_bytes(file)
        write_h5(root / "ply_data_test0.h5", mn_valid)
        try:
            check_modelnet(ModelNet40(str(root), npoints=NP, on_bad_file=mode, augment=augment, batch_size=2),
                           good=3 if mode == "skip" else 0)
        except UserError:
            event("UserError")
        else:
            event("valid")


# ---------------------------------------------------------------------------
# ModelNet40 through torch-geometric: OFF meshes

TETRAHEDRON = "OFF\n4 4 0\n1 1 1\n1 -1 -1\n-1 1 -1\n-1 -1 1\n3 0 1 2\n3 0 1 3\n3 0 2 3\n3 1 2 3\n"
NUMBER = st.sampled_from(["0", "1", "-1", "2.5", "nan", "inf", "1e39", "x", "", "3 3", "-7", "40"])


@st.composite
def off_text(draw) -> bytes:
    """A mesh: the valid tetrahedron mangled, or an OFF text with drawn counts, coordinates and faces."""
    if draw(st.booleans()):
        return draw(mangled(TETRAHEDRON.encode()))
    nv, nf = draw(st.integers(0, 5)), draw(st.integers(0, 4))
    header = draw(st.sampled_from([f"{nv} {nf} 0"] * 4 + [f"{nv + 1} {nf} 0", f"{nv} {nf}", "x y z"]))
    verts = [" ".join(draw(NUMBER) if draw(st.integers(0, 12)) == 0 else str(draw(st.integers(-2, 2)))
                      for _ in range(3)) for _ in range(nv)]  # fmt: skip
    faces = [" ".join(["3"] + [str(draw(st.integers(-1, nv))) for _ in range(3)]) for _ in range(nf)]
    return "\n".join(["OFF", header, *verts, *faces, ""]).encode()


@fuzz(25)
@given(mesh=off_text(), mode=on_bad_file)
def test_modelnet40_pyg(mesh, mode):
    with folder() as root:
        raw = root / "raw"
        for c in MODELNET40_CLASSES:
            (raw / c).mkdir(parents=True)
        for c, split in (("airplane", "train"), ("bathtub", "test")):
            (raw / c / split).mkdir()
            (raw / c / split / f"{c}_0001.off").write_text(TETRAHEDRON)
        (raw / "bed" / "train").mkdir()
        (raw / "bed" / "train" / "bed_0001.off").write_bytes(mesh)
        try:
            check_modelnet(ModelNet40PyG(str(root), npoints=NP, on_bad_file=mode, batch_size=1),
                           good=1 if mode == "skip" else 0)
        except UserError:
            event("UserError")
        else:
            event("valid")


# ---------------------------------------------------------------------------
# ShapeNetPart: txt release, HDF5 release, torch-geometric


def check_parts(dm, good: dict[str, int]):
    dm.setup()
    assert all(isinstance(s, str) and s for s in dm.skipped)
    for split in ("train", "val", "test"):
        dataset = getattr(dm, f"{split}_set")
        assert len(dataset) >= good.get(split, 1)
        for i in range(len(dataset)):
            sample = dataset[i]
            assert_points(sample["points"], dm.npoints)
            category = int(sample["category"])
            assert sample["category"].dtype == torch.int64 and 0 <= category < 16
            parts = sample["parts"]
            assert parts.dtype == torch.int64 and parts.shape == (dm.npoints,)
            assert set(parts.tolist()) <= set(CATEGORY_PARTS[category])
            if "normals" in sample:
                assert_points(sample["normals"], dm.npoints)


TOKEN = st.sampled_from(["0", "1", "-0.5", "2", "3", "4", "nan", "inf", "-inf", "1e39", "1e300", "3.5", "x", "",
                         "1,0", "0x1", "NaN", "-1", "5", "1e-320"])  # fmt: skip


@st.composite
def shape_text(draw, valid: bytes) -> bytes:
    """A shape file: ``valid`` mangled, or rows 'x y z nx ny nz part' with drawn tokens and junk lines."""
    if draw(st.booleans()):
        return draw(mangled(valid))
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 5)) == 0:
            rows.append(draw(st.sampled_from(["", "# comment", "junk line", "1 2 3", "\t", "1 2 3 4 5 6 7 8"])))
        else:
            rows.append(" ".join(draw(TOKEN) if draw(st.integers(0, 12)) == 0 else str(draw(st.integers(-1, 4)))
                                 for _ in range(7)))  # fmt: skip
    return "\n".join(rows).encode()


@fuzz(40)
@given(data=st.data(), mode=on_bad_file, normals=st.booleans())
def test_shapenet_part_txt(shapenet_txt_release, data, mode, normals):
    with folder() as root:
        written = shapenet_txt_release(root, counts={"train": 2, "val": 1, "test": 1}, categories=(0,), points=(5, 8))
        target = written["train"][0][0]
        lists = root / "train_test_split" / "shuffled_train_file_list.json"
        what = data.draw(st.sampled_from(["shape", "shape", "shape", "listing"]))
        if what == "shape":
            target.write_bytes(data.draw(shape_text(target.read_bytes())))
        else:  # a drawn extra entry in the train list
            entry = data.draw(st.sampled_from([f"shape_data/{SYNSETS[0]}/missing", "shape_data/99999999/x", "bad",
                                               f"shape_data/{SYNSETS[0]}/{target.stem}", 7, None, ["x"]]))  # fmt: skip
            lists.write_text(json.dumps(json.loads(lists.read_text()) + [entry]))
        try:
            check_parts(ShapeNetPart(str(root), npoints=8, normals=normals, on_bad_file=mode, batch_size=1),
                        {"train": 1 if mode == "skip" else 0})
        except UserError:
            event("UserError")
        else:
            event("valid")


sp_valid = {"data": np.random.default_rng(1).uniform(-1, 1, (2, P, 3)).astype(np.float32),
            "label": np.array([[0], [15]], np.uint8),
            "pid": np.concatenate([np.full((1, P), 3), np.full((1, P), 47)]).astype(np.uint8)}  # fmt: skip
sp_fuzzed = {
    "data": array([(2, P, 3), (2, P, 3), (2, P), (2, 5, 3), (0, P, 3), (1, P, 3)], ["float32", "float64", "int16"],
                  -2, 2),
    "label": array([(2, 1), (2, 1), (2,), (2, 3), (3, 1)], ["uint8", "int64", "float64"], -2, 20,
                   specials=[2**40, 255, -1]),
    "pid": array([(2, P), (2, P), (2, 5), (2, P, 1), (2,)], ["uint8", "int32", "float32"], -1, 55,
                 specials=[2**31 - 1, 3, 47]),
}  # fmt: skip


@fuzz(40)
@given(file=h5_file(sp_valid, sp_fuzzed), mode=on_bad_file)
def test_shapenet_part_h5(file, mode):
    with folder() as root:
        for name in ("ply_data_train0.h5", "ply_data_val0.h5", "ply_data_test0.h5"):
            write_h5(root / name, sp_valid)
        (root / "ply_data_train1.h5").write_bytes(file)
        try:
            check_parts(ShapeNetPartH5(str(root), npoints=16, on_bad_file=mode, batch_size=1),
                        {"train": 2 if mode == "skip" else 0})
        except UserError:
            event("UserError")
        else:
            event("valid")


@fuzz(25)
@given(data=st.data(), mode=on_bad_file)
def test_shapenet_part_pyg(shapenet_txt_release, data, mode):
    with folder() as root:
        written = shapenet_txt_release(root / "raw", counts={"train": 2, "val": 1, "test": 1}, categories=(0,),
                                       points=(5, 8))  # fmt: skip
        target = written["train"][0][0]
        target.write_bytes(data.draw(shape_text(target.read_bytes())))
        try:
            check_parts(ShapeNetPartPyG(str(root), npoints=8, on_bad_file=mode, batch_size=1),
                        {"train": 1 if mode == "skip" else 0})
        except UserError:
            event("UserError")
        else:
            event("valid")


# ---------------------------------------------------------------------------
# CIFAR-10, python release (pickles)


class _Callable:
    def __reduce__(self):
        return (print, ("pickles must not run code",))


def cifar_batch(n: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"x", b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}  # fmt: skip


@st.composite
def cifar_pickle(draw, valid: dict) -> bytes:
    """A batch or meta file: the valid pickle mangled, or a pickle of a drawn malformed structure."""
    if draw(st.booleans()):
        return draw(mangled(pickle.dumps(valid, protocol=draw(st.sampled_from([2, 4])))))
    batch = dict(valid)
    key = draw(st.sampled_from([b"data", b"labels", b"label_names"]))
    batch[key] = draw(st.sampled_from([
        None, "text", [1, 2, 3], [11, -1, 0], [1.5, 2.0, 0.0], [2**70, 0, 1], ["a", "b", "c"], [[1], [2, 3], []],
        np.zeros((3, 3072), np.float32), np.zeros((3, 100), np.uint8), np.zeros((2, 3072), np.uint8),
        np.zeros(3072, np.uint8), [b"n"] * 10, [b"n"] * 9, _Callable(),
    ]))  # fmt: skip
    if draw(st.integers(0, 4)) == 0:
        batch = draw(st.sampled_from([[1, 2], "x", 3, {b"data": None}]))
    return pickle.dumps(batch, protocol=2)


@fuzz(40)
@given(data=st.data(), mode=on_bad_file)
def test_cifar10(data, mode):
    with folder() as root:
        for i in range(1, 6):
            (root / f"data_batch_{i}").write_bytes(pickle.dumps(cifar_batch(seed=i), protocol=2))
        (root / "test_batch").write_bytes(pickle.dumps(cifar_batch(), protocol=2))
        meta = {b"label_names": [f"c{i}".encode() for i in range(10)]}
        (root / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
        target = data.draw(st.sampled_from(["data_batch_2", "data_batch_2", "batches.meta"]))
        valid = meta if target == "batches.meta" else cifar_batch(seed=2)
        (root / target).write_bytes(data.draw(cifar_pickle(valid)))
        dm = CIFAR10(str(root), resolution=16, batch_size=2, on_bad_file=mode)
        try:
            dm.setup()
        except UserError:
            event("UserError")
            return
        event("valid")
        assert dm.train_images.dtype == torch.uint8 and dm.train_images.shape[1:] == (3, 16, 16)
        assert len(dm.train_images) >= (12 if mode == "skip" else 15) and len(dm.class_names) == 10
        assert dm.train_labels.dtype == torch.int64 and ((dm.train_labels >= 0) & (dm.train_labels < 10)).all()


# ---------------------------------------------------------------------------
# images and masks: ImageFolder, VOC, ADE20K, Cityscapes, GID

MODES = ["1", "L", "P", "RGB", "RGBA", "LA", "I", "I;16", "F", "CMYK"]
FORMATS = {"PNG": ("1", "L", "P", "RGB", "RGBA", "LA", "I;16"), "JPEG": ("L", "RGB", "CMYK"),
           "BMP": ("1", "L", "P", "RGB"), "GIF": ("L", "P"), "TIFF": MODES}  # fmt: skip


def encode(array: np.ndarray, mode: str, fmt: str) -> bytes:
    from io import BytesIO

    if mode == "P":
        img = Image.fromarray(array.astype(np.uint8), "P")
        img.putpalette(bit_colormap(256).ravel().tolist())
    elif mode in ("RGB", "RGBA", "CMYK"):
        img = Image.fromarray(np.repeat(array[..., None], len(mode), axis=2).astype(np.uint8), mode)
    elif mode == "LA":
        img = Image.fromarray(np.stack([array, array], axis=2).astype(np.uint8), "LA")
    elif mode in ("I", "I;16", "F"):  # Pillow picks the mode from the dtype
        img = Image.fromarray(array.astype({"I": np.int32, "I;16": np.uint16, "F": np.float32}[mode]))
    else:
        img = Image.fromarray(array.astype(np.uint8), "L").convert(mode)
    out = BytesIO()
    img.save(out, fmt)
    return out.getvalue()


@st.composite
def image_file(draw, size: tuple[int, int], values: st.SearchStrategy = st.integers(0, 255), mode=None,
               fmt=None) -> bytes:  # fmt: skip
    """An encoded image (drawn format, mode, size, values) or such bytes mangled."""
    fmt = fmt or draw(st.sampled_from(sorted(FORMATS)))
    mode = mode if mode is not None and draw(st.integers(0, 2)) else draw(st.sampled_from(FORMATS[fmt]))
    h, w = size if draw(st.integers(0, 3)) else (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    array = rng.choice(draw(st.lists(values, min_size=1, max_size=4)), (h, w))
    encoded = encode(array, mode, fmt)
    return draw(mangled(encoded)) if draw(st.integers(0, 2)) == 0 else encoded


def valid(size=(12, 16), value=0, mode="RGB", fmt="PNG") -> bytes:
    return encode(np.full(size, value), mode, fmt)


@fuzz(35)
@given(file=image_file((12, 16)), mode=on_bad_file)
def test_image_folder(file, mode):
    with folder() as root:
        for name in ("a.png", "b.png"):
            (root / "cats" / name).parent.mkdir(exist_ok=True)
            (root / "cats" / name).write_bytes(valid(value=100))
        (root / "dogs").mkdir()
        (root / "dogs" / "c.img").write_bytes(file)
        dm = ImageFolder(str(root), resolution=8, batch_size=2, on_bad_file=mode)
        try:
            dm.setup()
        except UserError:
            event("UserError")
            return
        event("valid")
        assert dm.train_images.dtype == torch.uint8 and dm.train_images.shape[1:] == (3, 8, 8)
        assert len(dm.train_images) in (2, 3) and len(dm.train_images) + len(dm.skipped) == 3
        assert dm.train_labels.dtype == torch.int64 and set(dm.train_labels.tolist()) <= {0, 1}


def check_segmentation(dm, good_train: int, valid_values):
    dm.setup()
    assert all(isinstance(s, str) and s for s in dm.skipped)
    assert len(dm.train_set) >= good_train
    for split in ("train", "val", "test"):
        dataset = getattr(dm, f"{split}_set")
        for i in range(len(dataset)):
            sample = dataset[i]  # may raise UserError: bad pixels are found when loaded
            image, mask = sample["image"], sample["mask"]
            assert image.dtype == torch.float32 and image.shape[0] == 3 and torch.isfinite(image).all()
            assert mask.dtype == torch.int64 and mask.shape == image.shape[1:]
            assert set(mask.unique().tolist()) <= valid_values


SIZE = (12, 16)
mask_values = st.sampled_from([0, 1, 5, 20, 21, 150, 151, 200, 254, 255, 7, 33, 34])


@st.composite
def pair(draw, mask_mode: str, image_fmt: str):
    """(image bytes, mask bytes, which one is fuzzed)."""
    which = draw(st.sampled_from(["image", "mask", "mask", "both"]))
    image = draw(image_file(SIZE, mode="RGB", fmt=image_fmt)) if which in ("image", "both") else \
        valid(SIZE, 90, "RGB", image_fmt)  # fmt: skip
    mask = draw(image_file(SIZE, mask_values, mode=mask_mode, fmt="PNG")) if which in ("mask", "both") else \
        valid(SIZE, 1, mask_mode)  # fmt: skip
    return image, mask


def write(path: Path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@fuzz(30)
@given(files=pair("P", "JPEG"), mode=on_bad_file)
def test_voc(files, mode):
    with folder() as root:
        base = root / "VOC2012"
        for id_, (image, mask) in {"good": (valid(SIZE, 90, "RGB", "JPEG"), valid(SIZE, 1, "P")), "bad": files}.items():
            write(base / "JPEGImages" / f"{id_}.jpg", image)
            write(base / "SegmentationClass" / f"{id_}.png", mask)
        write(base / "ImageSets" / "Segmentation" / "train.txt", b"good\nbad\n")
        write(base / "ImageSets" / "Segmentation" / "val.txt", b"good\n")
        try:
            check_segmentation(VOC(str(root), crop=8, batch_size=1, num_workers=0, on_bad_file=mode),
                               1, set(range(21)) | {255})
        except UserError:
            event("UserError")
        else:
            event("valid")


@fuzz(25)
@given(files=pair("L", "JPEG"), mode=on_bad_file)
def test_ade20k(files, mode):
    with folder() as root:
        for split, stem, (image, mask) in [("training", "a", (valid(SIZE, 90, "RGB", "JPEG"), valid(SIZE, 1, "L"))),
                                           ("training", "b", files),
                                           ("validation", "c", (valid(SIZE, 90, "RGB", "JPEG"), valid(SIZE, 0, "L")))]:
            write(root / "images" / split / f"{stem}.jpg", image)
            write(root / "annotations" / split / f"{stem}.png", mask)
        try:
            check_segmentation(ADE20K(str(root), crop=8, batch_size=1, num_workers=0, on_bad_file=mode),
                               1, set(range(150)) | {255})
        except UserError:
            event("UserError")
        else:
            event("valid")


@fuzz(25)
@given(files=pair("L", "PNG"), mode=on_bad_file, train_ids=st.booleans())
def test_cityscapes(files, mode, train_ids):
    suffix = "_gtFine_labelTrainIds.png" if train_ids else "_gtFine_labelIds.png"
    with folder() as root:
        for split, stem, (image, mask) in [("train", "x_000000_000019", (valid(SIZE, 90), valid(SIZE, 7, "L"))),
                                           ("train", "x_000001_000019", files),
                                           ("val", "y_000000_000019", (valid(SIZE, 90), valid(SIZE, 7, "L")))]:
            write(root / "leftImg8bit" / split / stem[0] / f"{stem}_leftImg8bit.png", image)
            write(root / "gtFine" / split / stem[0] / f"{stem}{suffix if stem[2] == '1' else '_gtFine_labelIds.png'}",
                  mask)  # fmt: skip
        try:
            check_segmentation(Cityscapes(str(root), crop=8, batch_size=1, num_workers=0, on_bad_file=mode),
                               1, set(range(19)) | {255})
        except UserError:
            event("UserError")
        else:
            event("valid")


def gid_label(seed: int, size=(16, 24)) -> np.ndarray:
    colours = np.concatenate([GID_PALETTE, [[0, 0, 0]]]).astype(np.uint8)
    return colours[np.random.default_rng(seed).integers(0, 16, size)]


@st.composite
def gid_label_file(draw) -> bytes:
    """A colour label: valid colours with a few drawn off-palette pixels, another mode or size, or mangled."""
    from io import BytesIO

    label = gid_label(draw(st.integers(0, 99)), draw(st.sampled_from([(16, 24), (16, 24), (8, 8), (17, 24)])))
    for _ in range(draw(st.integers(0, 2))):
        label[draw(st.integers(0, 7)), draw(st.integers(0, 7))] = draw(st.sampled_from([(1, 2, 3), (200, 0, 1)]))
    img = Image.fromarray(label, "RGB")
    img = img.convert(draw(st.sampled_from(["RGB", "RGB", "L", "P", "RGBA"])))
    out = BytesIO()
    img.save(out, draw(st.sampled_from(["TIFF", "PNG"])))
    return draw(mangled(out.getvalue())) if draw(st.integers(0, 2)) == 0 else out.getvalue()


@fuzz(25)
@given(label=gid_label_file(), image=st.one_of(st.none(), image_file((16, 24), mode="RGB", fmt="TIFF")),
       mode=on_bad_file)
def test_gid(label, image, mode):
    with folder() as root:
        base = root / "GID"
        write(base / "image_RGB" / "a.tif", valid((16, 24), 90, "RGB", "TIFF"))
        write(base / "label_15classes" / "a_label.tif", encode_rgb(gid_label(0)))
        write(base / "image_RGB" / "b.tif", image if image is not None else valid((16, 24), 90, "RGB", "TIFF"))
        write(base / "label_15classes" / "b_label.tif", label)
        try:
            check_segmentation(GID(str(root), patch=8, crop=8, batch_size=1, num_workers=0, on_bad_file=mode),
                               0, set(range(15)) | {255})
        except UserError:
            event("UserError")
        else:
            event("valid")


def encode_rgb(array: np.ndarray, fmt="TIFF") -> bytes:
    from io import BytesIO

    out = BytesIO()
    Image.fromarray(array, "RGB").save(out, fmt)
    return out.getvalue()
