"""Classification data modules (datamodules.classification: ImageNet / any folder, CIFAR-10/100, tiny digits)."""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from attention.errors import UserError
from datamodules import CIFAR10, CIFAR100, CIFAR10Classification, Digits, FolderClassification, ImageNet, TinyDigits
from datamodules.classification import CIFARClassification
from datamodules.formats import cifar
from datamodules.base import SKIPPED
from datamodules.classification import IMAGENET_MEAN, IMAGENET_STD, ClassificationDataset, FileSource, collate
from datamodules.formats.cifar import CIFAR10_CLASSES

COLOURS = {"n01440764": (200, 30, 30), "n01443537": (30, 200, 30), "n01484850": (30, 30, 200)}
EVAL = {"img_size": 16, "crop_pct": 1.0, "batch_size": 2, "num_workers": 0}


def write_jpeg(path: Path, colour, size=(20, 16)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, quality=95)


def imagenet_tree(root: Path, train=3, val=2) -> Path:
    """An ImageNet-layout folder: three wnid classes of flat-coloured JPEGs."""
    for wnid, colour in COLOURS.items():
        for i in range(train):
            write_jpeg(root / "train" / wnid / f"{wnid}_{i}.JPEG", colour)
        for i in range(val):
            write_jpeg(root / "val" / wnid / f"ILSVRC2012_val_{wnid}_{i}.JPEG", colour)
    return root


def normalised(colour) -> torch.Tensor:
    return (torch.tensor(colour, dtype=torch.float32) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)


def all_batches(loader):
    batches = list(loader)
    return torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches])


# ---------------------------------------------------------------------------
# folders


def test_folder_layout_reads_classes_labels_and_pixels(tmp_path):
    root = imagenet_tree(tmp_path / "imnet")
    dm = FolderClassification(str(root), **EVAL)
    assert dm.class_names == sorted(COLOURS) and dm.num_classes == 3  # known before setup
    dm.setup("fit")
    images, labels = all_batches(dm.val_dataloader())
    assert images.shape == (6, 3, 16, 16) and images.dtype == torch.float32
    assert labels.tolist() == [0, 0, 1, 1, 2, 2]
    for image, label in zip(images, labels):  # a flat colour stays that colour through resize and JPEG
        expected = normalised(COLOURS[dm.class_names[label]])
        assert torch.allclose(image.mean((1, 2)), expected, atol=0.06), (image.mean((1, 2)), expected)
    L.seed_everything(0, verbose=False)
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (2, 3, 16, 16) and batch["label"].dtype == torch.int64
    assert len(dm.train_dataloader()) == 4 and dm.test_set is dm.val_set  # 9 // 2, last partial batch dropped


def test_imagenet_knows_its_classes_without_data_and_checks_them(tmp_path):
    dm = ImageNet(str(tmp_path / "missing"), **EVAL)
    assert dm.num_classes == 1000 and dm.class_names is None  # mode=summary needs no data
    with pytest.raises(UserError, match="missing.*does not exist.*data.root.*valprep"):
        dm.setup()
    with pytest.raises(UserError, match=r"3 class folders.*1000.*data=folder_cls"):
        ImageNet(str(imagenet_tree(tmp_path / "imnet")), **EVAL).setup()
    dm = ImageNet(str(tmp_path / "imnet"), num_classes=3, **EVAL)
    dm.setup()
    assert dm.class_names == sorted(COLOURS)


def test_class_folders_that_differ_are_named(tmp_path):
    root = imagenet_tree(tmp_path / "d")
    (root / "val" / "n01484850").rename(root / "val" / "n99999999")
    with pytest.raises(UserError) as err:
        FolderClassification(str(root), **EVAL).setup()
    message = str(err.value)
    assert "train and val differ" in message
    assert "missing from" in message and "n01484850" in message  # in train, not in val
    assert "not in" in message and "n99999999" in message  # in val, not in train


def test_empty_class_is_named(tmp_path):
    root = imagenet_tree(tmp_path / "e")
    for f in (root / "val" / "n01443537").iterdir():
        f.unlink()
    with pytest.raises(UserError, match=r"1 class folder\(s\) of .*val hold no images: n01443537"):
        FolderClassification(str(root), **EVAL).setup()


def test_missing_split_and_flat_imagenet_val(tmp_path):
    root = imagenet_tree(tmp_path / "m")
    for d in (root / "val").iterdir():
        for f in d.iterdir():
            f.rename(root / "val" / f.name)  # the official val archive: flat
        d.rmdir()
    with pytest.raises(UserError, match=r"val has no class folders\. It holds 6 loose files.*valprep"):
        ImageNet(str(root), num_classes=3, **EVAL).setup()
    with pytest.raises(UserError, match=r"no validation/ folder \(it has train, val\)"):
        FolderClassification(str(root), val_dir="validation", **EVAL).setup()


def test_unreadable_images_fatal_or_skipped_and_counted(tmp_path, caplog):
    root = imagenet_tree(tmp_path / "b")
    bad = root / "train" / "n01440764" / "broken.JPEG"
    bad.write_bytes(b"not a jpeg")
    good = root / "train" / "n01443537" / "n01443537_0.JPEG"
    (root / "train" / "n01443537" / "cut.JPEG").write_bytes(good.read_bytes()[:200])  # truncated
    with pytest.raises(UserError) as err:
        FolderClassification(str(root), **EVAL).setup()
    assert str(bad) in str(err.value) and "2 unreadable files" in str(err.value)
    assert "cut.JPEG" in str(err.value) and "data.on_bad_file=skip" in str(err.value)
    dm = FolderClassification(str(root), on_bad_file="skip", **EVAL)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.train_set) == 9 and len(dm.skipped) == 2 and str(bad) in dm.skipped
    assert "Skipped 2 unreadable image(s)" in caplog.text


def test_a_file_found_bad_in_a_worker_is_named_or_dropped(tmp_path):
    """verify_images=false (ImageNet-size data): the decode in the loader names the file or drops it."""
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.new("RGB", (4, 4), (1, 2, 3)).save(good)
    bad.write_bytes(b"\x89PNG garbage")
    source = FileSource(tmp_path, [(good, 0), (bad, 1)])
    assert source.path(1) == bad and list(source.labels) == [0, 1]
    strict = ClassificationDataset(source, lambda im: torch.zeros(3, 4, 4), "error")
    with pytest.raises(UserError, match=r"bad\.png cannot be decoded.*data.on_bad_file=skip"):
        strict[1]
    lenient = ClassificationDataset(source, lambda im: torch.zeros(3, 4, 4), "skip")
    batch = collate([lenient[0], lenient[1]])
    assert batch["label"].tolist() == [0] and batch["image"].shape == (1, 3, 4, 4)
    # The dropped file travels with its batch to the run's process, which counts it (data/skipped).
    assert batch[SKIPPED] == [f"{bad}: cannot be decoded as an image (UnidentifiedImageError)"]
    assert SKIPPED not in collate([lenient[0], lenient[0]])
    with pytest.raises(UserError, match="unreadable"):
        collate([lenient[1]])


def test_a_16_bit_image_is_refused_in_the_worker_and_at_set_up(tmp_path):
    """A 16-bit greyscale PNG decoded to a white RGB image without a word, in the loader and in the set-up check."""
    root = imagenet_tree(tmp_path / "w", train=2, val=1)
    deep = root / "train" / "n01443537" / "deep.png"
    Image.fromarray(np.full((16, 20), 4000, np.uint16)).save(deep)  # PIL mode I;16
    source = FileSource(root / "train", [(deep, 1)])
    with pytest.raises(UserError, match=r"deep\.png cannot be decoded.*PIL mode I;16.*8-bit"):
        ClassificationDataset(source, lambda im: torch.zeros(3, 4, 4), "error")[0]
    with pytest.raises(UserError, match=r"deep\.png cannot be decoded.*PIL mode I;16.*on_bad_file=skip"):
        FolderClassification(str(root), **EVAL).setup()  # verify_images=auto: decoded at set-up
    dm = FolderClassification(str(root), on_bad_file="skip", **EVAL)
    dm.setup()
    assert dm.skipped == [str(deep)] and len(dm.train_set) == 6


def test_files_dropped_in_the_workers_are_counted_once(tmp_path):
    """verify_images=false with data.on_bad_file=skip: the workers drop the bad files as they decode them, and
    their count never reached the run (no data/skipped in metrics.json). The data module now counts each
    once from its batches, however many epochs meet it; two worker processes here."""
    root = imagenet_tree(tmp_path / "w", train=2, val=1)
    bad = next((root / "train").glob("*/*.JPEG"))
    bad.write_bytes(b"not an image")
    dm = FolderClassification(str(root), on_bad_file="skip", verify_images=False, **{**EVAL, "num_workers": 2})
    dm.setup()
    assert dm.skipped == []  # not checked in setup
    for _epoch in range(2):
        for batch in dm.train_dataloader():
            batch = dm.on_before_batch_transfer(batch, 0)
            assert SKIPPED not in batch  # taken out before the batch reaches the device and the task
    assert dm.skipped == [f"{bad}: cannot be decoded as an image (UnidentifiedImageError)"]


def test_bad_options_name_the_option(tmp_path):
    root = str(imagenet_tree(tmp_path / "o"))
    with pytest.raises(UserError, match="data.augment.rand_aug"):
        FolderClassification(root, augment={"rand_aug": 9})
    with pytest.raises(UserError, match="data.crop_pct"):
        FolderClassification(root, crop_pct=1.5)
    with pytest.raises(UserError, match="data.on_bad_file"):
        FolderClassification(root, on_bad_file="ignore")
    with pytest.raises(UserError, match="data.augment"):  # timm refuses the policy string
        FolderClassification(root, augment={"auto_augment": "nonsense-m9"}, **EVAL).setup()


def test_deit_training_transform(tmp_path):
    """RandAugment, random erasing and a bicubic random-resized crop, from timm's create_transform."""
    dm = FolderClassification(str(imagenet_tree(tmp_path / "t")), **EVAL)
    names = " ".join(type(t).__name__ for t in dm.train_transform().transforms)
    assert "RandomResizedCropAndInterpolation" in names and "RandAugment" in names and "RandomErasing" in names
    rrc = dm.train_transform().transforms[0]
    assert "bicubic" in str(rrc.interpolation).lower() and rrc.scale == (0.08, 1.0)


COMMON = {"img_size": 224, "batch_size": 128, "eval_batch_size": None, "num_workers": 8, "augment": None,
          "interpolation": "bicubic", "crop_pct": 0.875, "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
          "on_bad_file": "error", "verify_images": "auto", "verify_limit": 20000, "repeated_aug": 0, "seed": 0}


def test_hyperparameters_are_the_constructor_arguments(tmp_path):
    """Every argument of the data set's and the family base's constructor, defaults filled in, once."""
    assert dict(ImageNet("/x", batch_size=4).hparams) == {**COMMON, "batch_size": 4, "root": "/x", "num_classes": 1000,
                                                          "train_dir": "train", "val_dir": "val"}  # fmt: skip
    assert dict(CIFAR100("/x", val_size=5).hparams) == {**COMMON, "img_size": 32, "root": "/x", "download": False,
                                                        "url": None, "md5": "official", "val_size": 5}  # fmt: skip
    tiny = dict(TinyDigits(seed=3).hparams)
    assert tiny == {**COMMON, "img_size": 32, "num_workers": 0, "crop_pct": 1.0, "augment": tiny["augment"],
                    "seed": 3, "val_size": 250, "test_size": 250}  # fmt: skip
    assert tiny["augment"]["scale"] == (0.6, 1.0) and tiny["augment"]["auto_augment"] is None


def test_messages_suggest_each_data_sets_defaults(tmp_path):
    root = str(imagenet_tree(tmp_path / "o"))
    cases = [(lambda: FolderClassification(root, num_workers=-1), "data.num_workers=8"),
             (lambda: TinyDigits(num_workers=-1), "data.num_workers=0"),
             (lambda: CIFAR100("/x", img_size=0), "data.img_size=32"),
             (lambda: ImageNet("/x", img_size=0), "data.img_size=224"),
             (lambda: TinyDigits(batch_size=0), "data.batch_size=128")]  # fmt: skip
    for make, example in cases:
        with pytest.raises(UserError, match=re.escape(example)):
            make()


def test_instances_hold_their_own_class_names():
    dm = TinyDigits()
    dm.class_names.append("x")
    assert TinyDigits().class_names == [str(d) for d in range(10)]


# ---------------------------------------------------------------------------
# CIFAR


def cifar_rows(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (n, 3072)).astype(np.uint8)


def write_cifar10(root: Path, per_batch: int = 2) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        batch = {b"data": cifar_rows(per_batch, i), b"labels": [(i + k) % 10 for k in range(per_batch)],
                 b"batch_label": name.encode()}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {b"label_names": [n.encode() for n in CIFAR10_CLASSES], b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def write_cifar100(root: Path, n_train: int = 6, n_test: int = 4) -> Path:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        split = {b"data": cifar_rows(n, seed), b"fine_labels": [(7 * k + seed) % 100 for k in range(n)],
                 b"coarse_labels": [k % 20 for k in range(n)], b"filenames": [b"x.png"] * n}
        (folder / name).write_bytes(pickle.dumps(split, protocol=2))
    meta = {b"fine_label_names": [f"class{k}".encode() for k in range(100)],
            b"coarse_label_names": [f"super{k}".encode() for k in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def test_cifar10_reads_the_python_release(tmp_path):
    write_cifar10(tmp_path)
    dm = CIFAR10Classification(str(tmp_path), img_size=32, crop_pct=1.0, batch_size=2, num_workers=0)
    assert dm.num_classes == 10
    dm.setup()
    assert len(dm.train_set) == 10 and len(dm.val_set) == 2 and dm.test_set is dm.val_set
    images, labels = all_batches(dm.test_dataloader())
    assert labels.tolist() == [5, 6]  # test_batch is the 6th file written: labels (5 + k) % 10
    row = cifar_rows(2, 5)[1]  # R, G, B planes of 32x32, row-major
    pixel = torch.tensor([row[c * 1024 + 3 * 32 + 7] for c in range(3)], dtype=torch.float32)
    expected = (pixel / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(images[1, :, 3, 7], expected, atol=1e-5)  # 32 -> 32 with crop_pct 1: untouched


def test_cifar10_missing_files_say_how_to_get_them(tmp_path):
    folder = write_cifar10(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(UserError, match=r"lacks data_batch_3.*data.download=true.*data=tiny"):
        CIFAR10Classification(str(tmp_path), num_workers=0).setup()


def test_cifar100_fine_labels_names_and_holdout(tmp_path):
    write_cifar100(tmp_path)
    dm = CIFAR100(str(tmp_path), batch_size=2, num_workers=0)
    assert dm.num_classes == 100 and dm.img_size == 32
    dm.setup()
    assert dm.class_names[:2] == ["class0", "class1"] and len(dm.class_names) == 100
    assert len(dm.train_set) == 6 and len(dm.val_set) == 4
    assert list(dm.val_set.source.labels) == [(7 * k + 2) % 100 for k in range(4)]
    held = CIFAR100(str(tmp_path), batch_size=2, num_workers=0, val_size=2)
    held.setup()
    assert len(held.train_set) == 4 and len(held.val_set) == 2 and len(held.test_set) == 4
    train_rows = {r.tobytes() for r in held.train_set.source.images}
    assert not train_rows & {r.tobytes() for r in held.val_set.source.images}  # disjoint


def test_cifar100_bad_files_are_named(tmp_path):
    folder = write_cifar100(tmp_path)
    (folder / "train").write_bytes(pickle.dumps({b"data": cifar_rows(2, 0), b"labels": [1, 2]}, protocol=2))
    with pytest.raises(UserError, match=r"cifar-100-python/train is not a CIFAR-100 split.*b'fine_labels'"):
        CIFAR100(str(tmp_path), num_workers=0).setup()
    (folder / "train").write_bytes(b"cos\nsystem\n(S'echo hacked'\ntR.")  # a pickle that would run a command
    with pytest.raises(UserError, match=r"refused, nothing was run.*cifar-100-python.tar.gz"):
        CIFAR100(str(tmp_path), num_workers=0).setup()


def test_cifar10_files_are_read_alike_for_the_gan_and_for_classification(tmp_path):
    """One reader: the GAN's data=cifar10 and data=cifar10_cls see the same pixels and labels."""
    write_cifar10(tmp_path)
    gan = CIFAR10(str(tmp_path), batch_size=2)
    gan.setup()
    cls = CIFAR10Classification(str(tmp_path), num_workers=0)
    cls.setup()
    hwc = gan.train_images.permute(0, 2, 3, 1).numpy()  # (N, 3, 32, 32) -> (N, 32, 32, 3)
    np.testing.assert_array_equal(cls.train_set.source.images, hwc)
    np.testing.assert_array_equal(cls.train_set.source.labels, gan.train_labels.numpy())
    assert cls.class_names == gan.class_names == CIFAR10_CLASSES


def test_a_new_cifar_style_release_is_one_subclass(tmp_path):
    """A data set in the CIFAR format needs its Release and a name, no constructor."""
    three = cifar.Release(
        name="CIFAR-3", folder="cifar-3-py", archive="cifar-3.tar.gz", url="https://example.org/cifar-3.tar.gz",
        md5="0" * 32, train_files=("train",), test_file="test", meta_file="meta", listing="train, test and meta",
        unit="split", labels_key=b"y", names_key=b"names", num_classes=3,
    )  # fmt: skip

    class CIFAR3(CIFARClassification):
        name = "CIFAR-3"
        release = three

    folder = tmp_path / "cifar-3-py"
    folder.mkdir()
    for name, n, seed in (("train", 5, 1), ("test", 2, 2)):
        split = {b"data": cifar_rows(n, seed), b"y": [k % 3 for k in range(n)]}
        (folder / name).write_bytes(pickle.dumps(split, protocol=2))
    dm = CIFAR3(str(tmp_path), batch_size=2, num_workers=0)
    assert dm.num_classes == 3 and dm.class_names is None and dm.url == three.url and dm.md5 == three.md5
    with pytest.raises(UserError, match=r"CIFAR-3 not found: .*lacks meta.*train, test and meta.*cifar-3.tar.gz"):
        dm.setup()
    (folder / "meta").write_bytes(pickle.dumps({b"names": [b"a", b"b", b"c"]}, protocol=2))
    dm.setup()
    assert dm.class_names == ["a", "b", "c"] and len(dm.train_set) == 5 and len(dm.val_set) == 2
    assert list(dm.train_set.source.labels) == [0, 1, 2, 0, 1]
    (folder / "test").write_bytes(pickle.dumps({b"data": cifar_rows(1, 0), b"y": [3]}, protocol=2))
    with pytest.raises(UserError, match=r"cifar-3-py/test: image 0 has label 3, expected 0..2.*cifar-3.tar.gz"):
        CIFAR3(str(tmp_path), num_workers=0).setup()


# ---------------------------------------------------------------------------
# tiny


def test_tiny_digits_split_and_batches():
    dm = TinyDigits(batch_size=32, eval_batch_size=250)
    assert (dm.num_classes, dm.img_size, dm.class_names[3]) == (10, 32, "3")
    dm.setup()
    sizes = [len(dm.train_set), len(dm.val_set), len(dm.test_set)]
    assert sizes == [1297, 250, 250]
    rows = [{r.tobytes() for r in s.source.images} for s in (dm.train_set, dm.val_set, dm.test_set)]
    assert not (rows[0] & rows[2]) and not (rows[1] & rows[2])  # no test digit is trained or validated on
    images, labels = all_batches(dm.val_dataloader())
    assert images.shape == (250, 3, 32, 32) and set(labels.tolist()) == set(range(10))
    again = TinyDigits(batch_size=32)
    again.setup()
    assert np.array_equal(again.test_set.source.labels, dm.test_set.source.labels)  # a fixed split
    L.seed_everything(0, verbose=False)
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (32, 3, 32, 32) and batch["label"].dtype == torch.int64


def test_tiny_digits_are_the_gans_digits():
    """One reader: data=tiny's three splits together are data=digits' 1,797 images at 32 px, with their labels."""
    tiny = TinyDigits(num_workers=0)
    tiny.setup()
    gan = Digits(resolution=32)
    gan.setup()
    hwc = gan.train_images.permute(0, 2, 3, 1).numpy()  # (N, 3, 32, 32) -> (N, 32, 32, 3)
    expected = sorted(zip((r.tobytes() for r in hwc), gan.train_labels.tolist()))
    got = sorted((r.tobytes(), int(y)) for s in (tiny.train_set, tiny.val_set, tiny.test_set)
                 for r, y in zip(s.source.images, s.source.labels))  # fmt: skip
    assert got == expected


# --- DeiT's repeated augmentation (data.repeated_aug) ----------------------------------------------------------------
def test_repeated_augmentation_serves_timms_indices_with_the_run_seed():
    """Each process's indices are those of timm's RepeatAugSampler (DeiT's RASampler) with its generator seeded by
    (seed, epoch): each image 3 times an epoch, copies on consecutive processes, 600 // 256 * 256 / 2 = 256 per
    process. timm seeds with the epoch alone: every run seed drew the same order."""
    from timm.data.distributed_sampler import RepeatAugSampler
    from torch.utils.data import DistributedSampler

    from datamodules.classification.repeated import RepeatedAugmentation

    data = list(range(600))
    for epoch in (0, 3):
        streams = []
        for rank in (0, 1):
            ours = RepeatedAugmentation(data, 5, 3, processes=2, rank=rank)
            ours.set_epoch(epoch)
            timm = RepeatAugSampler(data, num_replicas=2, rank=rank, num_repeats=3)
            timm.set_epoch(5 + epoch)
            streams.append(list(ours))
            assert streams[-1] == list(timm) and len(ours) == 256 and ours.epoch == epoch
            assert isinstance(ours, DistributedSampler)  # Lightning leaves it alone under DDP
        interleaved = [i for pair in zip(*streams) for i in pair]
        assert interleaved[:6] == [interleaved[0]] * 3 + [interleaved[3]] * 3  # copies on consecutive processes
    other = RepeatedAugmentation(data, 6, 3, processes=2, rank=0)
    assert list(other) != list(RepeatedAugmentation(data, 5, 3, processes=2, rank=0))  # the seed matters


def test_repeated_augmentation_is_one_option_away_and_checked():
    from datamodules.classification.repeated import RepeatedAugmentation
    from datamodules.loaders import EpochRandomSampler

    L.seed_everything(3, verbose=False)
    dm = TinyDigits(batch_size=12, repeated_aug=3)
    dm.setup()
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, RepeatedAugmentation) and loader.sampler.seed == 3
    assert len(loader) == len(dm.train_set) // 256 * 256 // 12  # one process: the copies in one stream
    labels = next(iter(loader))["label"]
    assert torch.equal(labels[0::3], labels[1::3]) and torch.equal(labels[0::3], labels[2::3])
    assert isinstance(TinyDigits(batch_size=12).train_sampling(dm.train_set)["sampler"], EpochRandomSampler)
    with pytest.raises(UserError, match=r"data\.repeated_aug"):
        TinyDigits(repeated_aug=-1)
