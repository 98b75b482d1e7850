"""GAN data modules (datamodules.generation: Digits, CIFAR10, ImageFolder) on real digits and files written here."""

import hashlib
import io
import logging
import os
import pickle
import re
import tarfile
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image
from sklearn.datasets import load_digits

from attention.errors import UserError
from datamodules import CIFAR10, Digits, ImageDataModule, ImageFolder
from datamodules.formats.cifar import CIFAR10_CLASSES
from datamodules.formats.cifar import CIFAR10 as CIFAR10_RELEASE

CIFAR10_FOLDER = CIFAR10_RELEASE.folder

# ---------------------------------------------------------------------------
# helpers


def first_batch(dm, seed=0):
    L.seed_everything(seed, verbose=False)
    return next(iter(dm.train_dataloader()))


def image_keys(images: torch.Tensor) -> list[bytes]:
    """One bytes key per image of uint8 (N, 3, R, R) or float [-1, 1] images (converted at once, in numpy:
    thousands of tiny torch ops are slow on a busy 2-core machine)."""
    if images.dtype != torch.uint8:
        images = ((images + 1) * 127.5).round().to(torch.uint8)
    array = np.ascontiguousarray(images.numpy())
    return [row.tobytes() for row in array.reshape(len(array), -1)]


def bilinear_reference(image: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of a 2-D float64 array, half-pixel centres, edges clamped (align_corners=False)."""

    def axis(n_in):
        src = np.clip((np.arange(size) + 0.5) * (n_in / size) - 0.5, 0, None)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, src - lo

    r0, r1, wr = axis(image.shape[0])
    c0, c1, wc = axis(image.shape[1])
    rows = image[r0] * (1 - wr)[:, None] + image[r1] * wr[:, None]  # (size, W)
    return rows[:, c0] * (1 - wc) + rows[:, c1] * wc


@pytest.fixture(scope="module")
def digits():
    dm = Digits(batch_size=16, flip=False)
    dm.setup()
    return dm


# ---------------------------------------------------------------------------
# Digits


def test_digits_images_labels_and_attributes(digits):
    assert digits.num_classes == 10 and digits.class_names == [str(d) for d in range(10)]
    images, labels = digits.train_images, digits.train_labels
    assert images.dtype == torch.uint8 and images.shape == (1797, 3, 32, 32)
    assert labels.dtype == torch.int64 and labels.shape == (1797,)
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert torch.equal(images[:, 0], images[:, 1]) and torch.equal(images[:, 0], images[:, 2])  # grey
    sk = load_digits()
    np.testing.assert_array_equal(labels.numpy(), sk.target)
    for i in (0, 5, 1796):
        expected = bilinear_reference(sk.images[i].astype(np.float64), 32) * 255.0 / 16.0
        assert np.abs(images[i, 0].numpy().astype(np.float64) - expected).max() <= 1.0
    assert images.max() == 255 and images.min() == 0


def test_attributes_exist_before_setup():
    dm = Digits(resolution=16)
    assert dm.num_classes == 10 and len(dm.class_names) == 10 and dm.resolution == 16
    assert dm.train_images is None and dm.fingerprint is None
    dm.setup()
    assert dm.train_images.shape == (1797, 3, 16, 16)
    loaded = dm.train_images
    dm.setup()  # idempotent: nothing reloaded
    assert dm.train_images is loaded


def test_digits_batches(digits):
    dm = Digits(batch_size=8, batches_per_step=3, flip=False)
    batch = first_batch(dm)
    assert set(batch) == {"image", "label"}
    assert batch["image"].dtype == torch.float32 and batch["image"].shape == (24, 3, 32, 32)
    assert batch["label"].dtype == torch.int64 and batch["label"].shape == (24,)
    assert batch["image"].min() >= -1 and batch["image"].max() <= 1
    # every image is a training image scaled to [-1, 1] (exactly), with its own label
    assert torch.equal(batch["image"], ((batch["image"] + 1) * 127.5).round() / 127.5 - 1)
    labels_of = {}
    for key, label in zip(image_keys(digits.train_images), digits.train_labels.tolist()):
        labels_of.setdefault(key, set()).add(label)
    for key, label in zip(image_keys(batch["image"]), batch["label"].tolist()):
        assert label in labels_of[key]
    loader = dm.train_dataloader()
    assert len(loader) == 1797 // 24  # drop_last
    assert torch.equal(first_batch(dm, seed=3)["image"], first_batch(dm, seed=3)["image"])
    assert not torch.equal(first_batch(dm, seed=3)["image"], first_batch(dm, seed=4)["image"])


def test_flip_is_random_and_seeded(digits):
    keys = set(image_keys(digits.train_images))
    mirrored = set(image_keys(digits.train_images.flip(-1)))

    def as_uint8(batch):
        return image_keys(batch["image"])

    dm = Digits(batch_size=1797, flip=True)
    got = as_uint8(first_batch(dm, seed=1))
    assert all(k in keys or k in mirrored for k in got)
    flipped = sum(k not in keys for k in got)
    assert 700 < flipped < 1100  # about half, minus the few mirror-symmetric digits
    assert as_uint8(first_batch(dm, seed=1)) == got
    plain = Digits(batch_size=1797, flip=False)
    assert all(k in keys for k in as_uint8(first_batch(plain, seed=1)))


def test_workers_are_seeded_too():
    dm = Digits(batch_size=32, flip=True, num_workers=2)
    a, b = first_batch(dm, seed=5), first_batch(dm, seed=5)
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


def test_fingerprint(digits):
    again = Digits(batch_size=4)
    again.setup()
    assert again.fingerprint == digits.fingerprint
    assert digits.fingerprint.startswith("digits-32px-n1797-") and len(digits.fingerprint.split("-")[-1]) == 12
    small = Digits(resolution=16)
    small.setup()
    assert small.fingerprint != digits.fingerprint and small.fingerprint.startswith("digits-16px-n1797-")


@pytest.mark.parametrize(
    "kwargs, option",
    [({"resolution": 4}, "data.resolution"), ({"batch_size": 0}, "data.batch_size"),
     ({"batches_per_step": -1}, "data.batches_per_step"), ({"num_workers": -1}, "data.num_workers"),
     ({"batch_size": 2.5}, "data.batch_size"), ({"resolution": "big"}, "data.resolution")],
)  # fmt: skip
def test_options_are_validated(kwargs, option):
    with pytest.raises(UserError, match=option):
        Digits(**kwargs)


COMMON = {"resolution": 32, "batch_size": 64, "batches_per_step": 1, "num_workers": 0, "flip": True, "seed": 0,
          "val_samples": 10000, "test_samples": None, "eval_batch_size": 50, "on_bad_file": "error"}


def test_hyperparameters_are_the_constructor_arguments(tmp_path):
    """What checkpoints and loggers record: every argument of the data set's and the family base's constructor
    (defaults filled in) once, though a data set names only its own options and passes the rest on."""
    assert dict(Digits(resolution=16).hparams) == {**COMMON, "resolution": 16}
    assert dict(CIFAR10("/x", batch_size=8).hparams) == {**COMMON, "batch_size": 8, "root": "/x", "download": False,
                                                         "url": CIFAR10_RELEASE.url, "md5": CIFAR10_RELEASE.md5}
    save(tmp_path / "a.png", np.zeros((8, 8, 3), np.uint8))
    assert dict(ImageFolder(str(tmp_path), on_bad_file="skip").hparams) == {**COMMON, "root": str(tmp_path),
                                                                            "on_bad_file": "skip"}  # fmt: skip


def test_messages_suggest_the_family_defaults():
    cases = [(lambda: CIFAR10("/x", batch_size=0), "data.batch_size=64"),
             (lambda: CIFAR10("/x", eval_batch_size=0), "data.eval_batch_size=50"),
             (lambda: Digits(test_samples=0), "data.test_samples=50000"),
             (lambda: Digits(seed=-1), "data.seed=0")]  # fmt: skip
    for make, example in cases:
        with pytest.raises(UserError, match=re.escape(example)):
            make()


class Squares(ImageDataModule):
    """A data set written as :mod:`datamodules.generation.base` says: its name, classes and ``_load``."""

    name = "squares"
    num_classes = 2
    class_names = ["dark", "light"]

    def _load(self):
        images = torch.zeros(6, 3, self.resolution, self.resolution, dtype=torch.uint8)
        images[3:] = 255
        return images, torch.tensor([0, 0, 0, 1, 1, 1])


def test_a_new_data_set_is_its_declarations():
    dm = Squares(resolution=8, batch_size=2, flip=False, val_samples=3)
    dm.class_names.append("grey")
    assert Squares.class_names == ["dark", "light"]  # instances hold copies
    assert dict(dm.hparams) == {**COMMON, "resolution": 8, "batch_size": 2, "flip": False, "val_samples": 3}
    dm.setup()
    assert dm.fingerprint.startswith("squares-8px-n6-")
    batch = first_batch(dm)
    assert batch["image"].shape == (2, 3, 8, 8) and batch["label"].dtype == torch.int64
    assert torch.equal(batch["image"][:, 0, 0, 0], batch["label"].float() * 2 - 1)  # dark -1, light +1
    assert torch.cat([b["index"] for b in dm.val_dataloader()]).tolist() == [0, 1, 2]
    with pytest.raises(UserError, match=re.escape("The squares training set has 6 images, fewer than one batch of "
                                                  "data.batch_size * data.batches_per_step = 4 * 2 = 8")):
        Squares(resolution=8, batch_size=4, batches_per_step=2).train_dataloader()


def test_eval_loaders_serve_latent_indices_in_order():
    """What a GAN evaluates on: {"index"} over range(val_samples) / range(test_samples), every one once."""
    dm = Digits(val_samples=7, eval_batch_size=3)
    batches = list(dm.val_dataloader())
    assert [set(b) for b in batches] == [{"index"}] * 3 and [len(b["index"]) for b in batches] == [3, 3, 1]
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(7))
    assert batches[0]["index"].dtype == torch.int64
    assert dm.eval_samples("test") == 1797  # test_samples=None: as many as training images
    assert torch.cat([b["index"] for b in dm.test_dataloader()]).tolist() == list(range(1797))


# ---------------------------------------------------------------------------
# CIFAR-10


def write_cifar(folder: Path, sizes=(4, 4, 4, 4, 4), test_size=3, seed=0):
    """A tiny python release (protocol-2 pickles, bytes keys) in folder; returns (data, labels) of train."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    datas, labels = [], []
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name, n in zip(names, [*sizes, test_size]):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        label = [int(x) for x in rng.integers(0, 10, n)]
        batch = {b"batch_label": name.encode(), b"labels": label, b"data": data,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(n)]}  # fmt: skip
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        if name != "test_batch":
            datas.append(data)
            labels.extend(label)
    meta = {b"num_cases_per_batch": sizes[0], b"label_names": [f"class{i}".encode() for i in range(10)],
            b"num_vis": 3072}  # fmt: skip
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return np.concatenate(datas), np.array(labels)


def test_cifar_decodes_the_release(tmp_path):
    data, labels = write_cifar(tmp_path / CIFAR10_FOLDER)
    # image 6 (third of data_batch_2): green channel, row 3, column 7
    data[6, 1 * 1024 + 3 * 32 + 7] = 200
    raw = pickle.loads((tmp_path / CIFAR10_FOLDER / "data_batch_2").read_bytes(), encoding="bytes")
    raw[b"data"][2, 1 * 1024 + 3 * 32 + 7] = 200
    blob = pickle.dumps(raw, protocol=2)  # as numpy 1.x (and the official release) name the array rebuilder:
    blob = blob.replace(b"cnumpy._core.multiarray\n_reconstruct\n", b"cnumpy.core.multiarray\n_reconstruct\n")
    assert b"numpy.core.multiarray" in blob
    (tmp_path / CIFAR10_FOLDER / "data_batch_2").write_bytes(blob)

    dm = CIFAR10(root=str(tmp_path), batch_size=4)
    assert dm.num_classes == 10 and dm.class_names == CIFAR10_CLASSES
    dm.setup()
    assert dm.class_names == [f"class{i}" for i in range(10)]  # from batches.meta
    assert dm.train_images.dtype == torch.uint8 and dm.train_images.shape == (20, 3, 32, 32)
    assert dm.train_images[6, 1, 3, 7] == 200
    np.testing.assert_array_equal(dm.train_images.reshape(20, 3072).numpy(), data)
    np.testing.assert_array_equal(dm.train_labels.numpy(), labels)
    assert dm.fingerprint.startswith("cifar10-32px-n20-")
    batch = first_batch(dm)
    assert batch["image"].shape == (4, 3, 32, 32) and batch["label"].dtype == torch.int64

    small = CIFAR10(root=str(tmp_path / CIFAR10_FOLDER), resolution=16)  # root may be the release folder
    small.setup()
    assert small.train_images.shape == (20, 3, 16, 16) and small.fingerprint != dm.fingerprint


def test_cifar_missing_release(tmp_path):
    dm = CIFAR10(root=str(tmp_path))
    assert dm.num_classes == 10 and dm.class_names == CIFAR10_CLASSES  # usable before the data exists
    with pytest.raises(UserError, match="data.download=true"):
        dm.prepare_data()
    write_cifar(tmp_path / CIFAR10_FOLDER)
    (tmp_path / CIFAR10_FOLDER / "test_batch").unlink()
    with pytest.raises(UserError, match="lacks test_batch"):
        CIFAR10(root=str(tmp_path)).setup()


def test_cifar_bad_contents(tmp_path):
    folder = tmp_path / CIFAR10_FOLDER
    write_cifar(folder)
    batch = pickle.loads((folder / "data_batch_3").read_bytes(), encoding="bytes")
    batch[b"labels"][0] = 10
    (folder / "data_batch_3").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(UserError, match="data_batch_3.*label 10"):
        CIFAR10(root=str(tmp_path)).setup()
    batch[b"labels"][0], batch[b"data"] = 1, batch[b"data"][:, :100]
    (folder / "data_batch_3").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(UserError, match=r"data_batch_3.*\(n, 3072\)"):
        CIFAR10(root=str(tmp_path)).setup()
    (folder / "data_batch_3").write_bytes(pickle.dumps(batch, protocol=2)[:50])
    with pytest.raises(UserError, match="data_batch_3.*truncated or corrupt"):
        CIFAR10(root=str(tmp_path)).setup()


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cifar_pickle_cannot_run_code(tmp_path):
    folder = tmp_path / CIFAR10_FOLDER
    write_cifar(folder)
    marker = tmp_path / "pwned"
    batch = pickle.loads((folder / "data_batch_4").read_bytes(), encoding="bytes")
    batch[b"data"] = Payload(marker)
    (folder / "data_batch_4").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(UserError, match=r"data_batch_4.*(posix|os)\.system.*refused"):
        CIFAR10(root=str(tmp_path)).setup()
    assert not marker.exists()


@pytest.fixture
def cifar_archive(tmp_path, http_folder):
    """The tiny release as cifar-10-python.tar.gz on the local server; returns (url, md5, data, labels)."""
    served, base = http_folder
    data, labels = write_cifar(tmp_path / "source" / CIFAR10_FOLDER)
    archive = served / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(tmp_path / "source" / CIFAR10_FOLDER, arcname=CIFAR10_FOLDER)
    return f"{base}/cifar-10-python.tar.gz", hashlib.md5(archive.read_bytes()).hexdigest(), data, labels


def test_cifar_download(tmp_path, cifar_archive):
    url, digest, data, labels = cifar_archive
    root = tmp_path / "data"
    dm = CIFAR10(root=str(root), download=True, url=url, md5=digest)
    dm.prepare_data()
    dm.setup()
    assert (root / CIFAR10_FOLDER / "batches.meta").is_file()
    np.testing.assert_array_equal(dm.train_images.reshape(-1, 3072).numpy(), data)
    np.testing.assert_array_equal(dm.train_labels.numpy(), labels)


def test_cifar_download_wrong_md5(tmp_path, cifar_archive):
    url, _, _, _ = cifar_archive
    dm = CIFAR10(root=str(tmp_path / "data"), download=True, url=url, md5="0" * 32)
    with pytest.raises(UserError, match="Checksum mismatch"):
        dm.prepare_data()
    assert not (tmp_path / "data" / CIFAR10_FOLDER).exists()


# ---------------------------------------------------------------------------
# ImageFolder


def save(path: Path, array: np.ndarray, fmt: str = "PNG"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, fmt)


def striped(width, height, horizontal=True):
    """RGB uint8 (height, width, 3): red / green / blue bands, the outer ones 1/8 of the long side."""
    a = np.zeros((height, width, 3), np.uint8)
    a[..., 1] = 255
    n = (width if horizontal else height) // 8
    if horizontal:
        a[:, :n] = (255, 0, 0)
        a[:, -n:] = (0, 0, 255)
    else:
        a[:n] = (255, 0, 0)
        a[-n:] = (0, 0, 255)
    return a


def test_class_folders_with_mixed_sizes(tmp_path, caplog):
    rng = np.random.default_rng(0)
    save(tmp_path / "cats" / "wide.png", striped(64, 32))
    save(tmp_path / "cats" / "tall.png", striped(20, 80, horizontal=False))
    save(tmp_path / "dogs" / "a.jpg", rng.integers(0, 256, (50, 70, 3), dtype=np.uint8), "JPEG")
    save(tmp_path / "dogs" / "b.jpeg", rng.integers(0, 256, (9, 9, 3), dtype=np.uint8), "JPEG")
    save(tmp_path / "dogs" / "grey.png", np.full((30, 30), 77, np.uint8))  # "L" mode -> RGB
    (tmp_path / "dogs" / ".DS_Store").write_bytes(b"\0junk")  # hidden: ignored
    (tmp_path / "empty").mkdir()  # no files: not a class
    save(tmp_path / "loose.png", striped(16, 16))  # ignored with a warning
    with caplog.at_level(logging.WARNING):
        dm = ImageFolder(root=str(tmp_path), resolution=16, batch_size=2)
    assert "loose.png" in caplog.text
    assert dm.num_classes == 2 and dm.class_names == ["cats", "dogs"]
    dm.setup()
    assert dm.train_images.dtype == torch.uint8 and dm.train_images.shape == (5, 3, 16, 16)
    assert dm.train_labels.tolist() == [0, 0, 1, 1, 1]
    # files sorted: tall.png, wide.png; the centre crop keeps only the green middle band
    green = torch.tensor([0, 255, 0], dtype=torch.uint8)[:, None, None].expand(3, 16, 16)
    for i in (0, 1):
        assert (dm.train_images[i].int() - green.int()).abs().max() <= 2
    assert (dm.train_images[4] == 77).all()
    assert dm.fingerprint.startswith("image_folder-16px-n5-")
    batch = first_batch(dm)
    assert batch["image"].shape == (2, 3, 16, 16)


def test_class_folders_are_searched_recursively(tmp_path, caplog):
    """A class whose images sit in sub-folders was dropped without a word; torchvision's ImageFolder and the
    classification folders read them."""
    for i in range(2):
        save(tmp_path / "cats" / f"{i}.png", np.full((8, 8, 3), 10, np.uint8))
    for i, part in enumerate(("part1", "part2/deeper", "part2")):
        save(tmp_path / "dogs" / part / f"{i}.png", np.full((8, 8, 3), 200, np.uint8))
    (tmp_path / "dogs" / "part2" / ".hidden").mkdir()
    save(tmp_path / "dogs" / "part2" / ".hidden" / "x.png", np.zeros((8, 8, 3), np.uint8))  # hidden: ignored
    (tmp_path / "birds" / "none").mkdir(parents=True)  # no file at any depth: not a class, and said so
    with caplog.at_level(logging.WARNING):
        dm = ImageFolder(root=str(tmp_path), resolution=8)
    assert dm.class_names == ["cats", "dogs"] and "birds" in caplog.text
    assert [p.relative_to(tmp_path).as_posix() for p, _ in dm.files] == [
        "cats/0.png", "cats/1.png", "dogs/part1/0.png", "dogs/part2/2.png", "dogs/part2/deeper/1.png"]
    dm.setup()
    assert dm.train_labels.tolist() == [0, 0, 1, 1, 1] and (dm.train_images[2:] == 200).all()


def test_flat_folder_is_one_class(tmp_path):
    folder = tmp_path / "faces"
    for i in range(3):
        save(folder / f"{i}.png", np.full((40, 24, 3), 10 * i, np.uint8))
    dm = ImageFolder(root=str(folder))
    assert dm.num_classes == 1 and dm.class_names == ["faces"]
    dm.setup()
    assert dm.train_images.shape == (3, 3, 32, 32) and dm.train_labels.tolist() == [0, 0, 0]
    assert (dm.train_images[2] == 20).all()
    with pytest.raises(UserError, match="data.batch_size"):
        dm.train_dataloader()  # 3 images < one batch of 64


@pytest.fixture
def folder_with_bad_files(tmp_path):
    folder = tmp_path / "imgs"
    for i in range(3):
        save(folder / f"ok{i}.png", np.full((32, 32, 3), 100, np.uint8))
    (folder / "notes.txt").write_text("not an image\n")
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(buffer, "PNG")
    (folder / "truncated.png").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    return folder


def test_bad_files_raise_by_default(folder_with_bad_files):
    dm = ImageFolder(root=str(folder_with_bad_files))
    with pytest.raises(UserError, match=r"notes\.txt.*data\.on_bad_file=skip"):
        dm.setup()
    (folder_with_bad_files / "notes.txt").unlink()
    with pytest.raises(UserError, match=r"truncated\.png.*data\.on_bad_file=skip"):
        ImageFolder(root=str(folder_with_bad_files)).setup()


def test_bad_files_skipped_and_counted(folder_with_bad_files, caplog):
    dm = ImageFolder(root=str(folder_with_bad_files), on_bad_file="skip", batch_size=3)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert dm.train_images.shape == (3, 3, 32, 32)
    assert "Skipped 2" in caplog.text and "notes.txt" in caplog.text and "truncated.png" in caplog.text
    assert first_batch(dm)["image"].shape == (3, 3, 32, 32)


def test_a_dangling_link_is_a_bad_file_not_dropped(folder_with_bad_files):
    """A link whose image was moved away was left out without a word (neither a file nor a folder)."""
    (folder_with_bad_files / "notes.txt").unlink()
    (folder_with_bad_files / "truncated.png").unlink()
    (folder_with_bad_files / "moved.png").symlink_to(folder_with_bad_files.parent / "elsewhere.png")
    with pytest.raises(UserError, match=r"moved\.png.*data\.on_bad_file=skip"):
        ImageFolder(root=str(folder_with_bad_files)).setup()
    dm = ImageFolder(root=str(folder_with_bad_files), on_bad_file="skip", batch_size=3)
    dm.setup()
    assert dm.train_images.shape[0] == 3 and len(dm.skipped) == 1 and "moved.png" in str(dm.skipped[0])


def test_high_bit_depth_images_are_refused_not_clipped(tmp_path):
    """A 16-bit or float image became a white or black RGB image without a word (convert("RGB") clips it)."""
    ramp = np.linspace(0, 65535, 16 * 16).reshape(16, 16).astype(np.uint16)
    save(tmp_path / "ok.png", np.full((16, 16, 3), 100, np.uint8))
    Image.fromarray(ramp).save(tmp_path / "ramp16.png")  # PIL mode I;16
    Image.fromarray((ramp / 65535).astype(np.float32)).save(tmp_path / "rampf.tif")  # mode F, values in 0..1
    with pytest.raises(UserError, match=r"ramp16\.png .*16-bit greyscale image \(PIL mode I;16\).*convert it to an "
                                        r"8-bit image.*data\.on_bad_file=skip") as err:
        ImageFolder(root=str(tmp_path), resolution=8).setup()
    assert "\n" not in str(err.value)
    dm = ImageFolder(root=str(tmp_path), resolution=8, on_bad_file="skip", batch_size=1)
    dm.setup()
    assert len(dm.train_images) == 1 and (dm.train_images == 100).all()
    assert [s.split(": ")[0] for s in dm.skipped] == [str(tmp_path / "ramp16.png"), str(tmp_path / "rampf.tif")]
    assert "PIL mode F" in dm.skipped[1] and "floating-point" in dm.skipped[1]


def test_folder_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ImageFolder(root=str(tmp_path / "nowhere"))
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / ".hidden.png").write_bytes(b"")
    with pytest.raises(UserError, match="empty holds no files"):
        ImageFolder(root=str(tmp_path / "empty"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("text")
    dm = ImageFolder(root=str(tmp_path / "junk"), on_bad_file="skip")
    with pytest.raises(UserError, match="no usable images"):
        dm.setup()
    with pytest.raises(UserError, match="data.on_bad_file"):
        ImageFolder(root=str(tmp_path / "junk"), on_bad_file="ignore")


# ---------------------------------------------------------------------------
# Hydra configs


def compose_data(overrides):
    with initialize_config_dir(config_dir=str(Path("configs").resolve()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return cfg, instantiate(cfg.data)


def test_configs_compose_and_instantiate(tmp_path):
    cfg, dm = compose_data(["data=digits"])
    assert type(dm) is Digits and not dm.flip and dm.seed == cfg.seed and dm.resolution == 32
    assert dm.batch_size == 64 and dm.batches_per_step == 1 and dm.num_workers == 0

    cfg, dm = compose_data(["data=cifar10", f"data_dir={tmp_path}"])
    assert type(dm) is CIFAR10 and dm.root == str(tmp_path) and dm.flip and not dm.download
    assert dm.md5 == "c58f30108f718f92721af3b95e74349a" and dm.url.endswith("cifar-10-python.tar.gz")
    assert dm.num_classes == 10 and dm.num_workers == 2

    save(tmp_path / "images" / "a" / "x.png", np.zeros((8, 8, 3), np.uint8))
    save(tmp_path / "images" / "b" / "y.png", np.zeros((8, 8, 3), np.uint8))
    cfg, dm = compose_data(["data=image_folder", f"data_dir={tmp_path}"])
    assert type(dm) is ImageFolder and dm.class_names == ["a", "b"] and dm.on_bad_file == "error"
    _, dm = compose_data(["data=image_folder", f"data.root={tmp_path / 'images' / 'a'}", "data.resolution=8"])
    assert dm.class_names == ["a"] and dm.resolution == 8
    assert all(isinstance(m, ImageDataModule) for m in (dm,))


def test_cifar_skip_drops_bad_batches_and_labels(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    (folder / "data_batch_2").write_bytes((folder / "data_batch_2").read_bytes()[:100])  # truncated
    batch = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 10, 3, -1]}
    (folder / "data_batch_3").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(UserError, match=r"data_batch_2 cannot be read as a CIFAR-10 pickle.*on_bad_file=skip"):
        CIFAR10(str(tmp_path)).setup()
    dm = CIFAR10(str(tmp_path), on_bad_file="skip")
    dm.setup()
    assert len(dm.train_images) == 4 * 3 + 2 and len(dm.skipped) == 3
    assert dm.skipped[0].startswith(f"{folder / 'data_batch_2'}: unreadable")
    assert dm.skipped[1:] == [f"{folder / 'data_batch_3'}[1]: label 10 outside 0..9",
                              f"{folder / 'data_batch_3'}[3]: label -1 outside 0..9"]  # fmt: skip
    with pytest.raises(UserError, match="data.on_bad_file must be"):
        CIFAR10(str(tmp_path), on_bad_file="maybe")
