"""Segmentation data modules on tiny fake releases written here in the official layouts, and Blobs."""

import inspect
import logging
import os
import re
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf
from PIL import Image

import datamodules.segmentation as seg
from attention.errors import UserError
from datamodules import ADE20K, GID, VOC, Blobs, Cityscapes, SegDataModule
from datamodules.segmentation import ArraySource, PadCollate, SegmentationDataset, TrainTransform, bit_colormap

H, W = 24, 32
MEAN = torch.tensor(seg.IMAGENET_MEAN)[:, None, None]
STD = torch.tensor(seg.IMAGENET_STD)[:, None, None]

# ---------------------------------------------------------------------------
# helpers


def save(path: Path, array: np.ndarray, palette: np.ndarray | None = None):
    """PNG / JPEG / TIFF by suffix; with ``palette`` a palette ("P") PNG of the indices in ``array``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(array)
    if palette is not None:
        img.putpalette(palette.ravel().tolist())  # L -> P, the pixel values stay the indices
        assert img.mode == "P"
    img.save(path)


def rgb(rng, h=H, w=W):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def decoded(path: Path) -> np.ndarray:
    return np.array(Image.open(path).convert("RGB"))


def pixels(image: torch.Tensor) -> torch.Tensor:
    """Undo the normalisation of (..., 3, H, W): back to 0..255."""
    return (image * STD + MEAN) * 255


def with_border(mask: np.ndarray, value=255) -> np.ndarray:
    mask = mask.copy()
    mask[0], mask[-1], mask[:, 0], mask[:, -1] = value, value, value, value
    return mask


def first_batch(loader, seed=0):
    L.seed_everything(seed, verbose=False)
    return next(iter(loader))


# ---------------------------------------------------------------------------
# fake releases


@pytest.fixture
def voc_root(tmp_path):
    """VOCdevkit/VOC2012 with palette masks (255 borders), train/val/trainaug lists and SegmentationClassAug.
    Returns (root, {id: mask}); val image 2007_000011 is smaller (20 x 28)."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "VOCdevkit" / "VOC2012"
    palette = bit_colormap(256)
    splits = {"train": ["2007_000032", "2007_000039", "2007_000063"], "val": ["2007_000033", "2007_000011"]}
    masks = {}
    for split, ids in splits.items():
        for id_ in ids:
            h, w = (20, 28) if id_ == "2007_000011" else (H, W)
            save(folder / "JPEGImages" / f"{id_}.jpg", rgb(rng, h, w))
            masks[id_] = with_border(rng.integers(0, 21, (h, w)).astype(np.uint8))
            save(folder / "SegmentationClass" / f"{id_}.png", masks[id_], palette)
    masks["2007_000032"][5, 5] = 20  # the largest class occurs
    save(folder / "SegmentationClass" / "2007_000032.png", masks["2007_000032"], palette)
    aug = ["2007_000032", "2008_000002", "2008_000003", "2008_000004"]
    for id_ in aug:
        if id_ != "2007_000032":
            save(folder / "JPEGImages" / f"{id_}.jpg", rgb(rng))
        masks[f"aug/{id_}"] = rng.integers(0, 21, (H, W)).astype(np.uint8)
        save(folder / "SegmentationClassAug" / f"{id_}.png", masks[f"aug/{id_}"])  # grey
    save(folder / "JPEGImages" / "2009_999999.jpg", rgb(rng))  # an image in no split: ignored
    lists = folder / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True)
    for split, ids in [*splits.items(), ("trainaug", aug)]:
        (lists / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
    return tmp_path, masks


@pytest.fixture
def ade_root(tmp_path):
    """ADEChallengeData2016 with 3 training and 2 validation pairs; masks use 0 and 150. Returns (root, masks)."""
    rng = np.random.default_rng(1)
    folder = tmp_path / "ADEChallengeData2016"
    masks = {}
    for split, n in (("training", 3), ("validation", 2)):
        for i in range(1, n + 1):
            stem = f"ADE_{'train' if split == 'training' else 'val'}_{i:08d}"
            save(folder / "images" / split / f"{stem}.jpg", rgb(rng))
            mask = rng.integers(0, 151, (H, W)).astype(np.uint8)
            mask[0, :3] = (0, 150, 1)
            masks[stem] = mask
            save(folder / "annotations" / split / f"{stem}.png", mask)
    return tmp_path, masks


CITYSCAPES_IDS = [0, 1, 4, 7, 8, 11, 12, 13, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 30, 31, 32, 33]  # 0..33


@pytest.fixture
def cityscapes_root(tmp_path):
    """leftImg8bit + gtFine for train (aachen: labelIds; bochum: labelIds and labelTrainIds) and val
    (frankfurt, a smaller image). Returns (root, {stem: (image, labelIds, labelTrainIds or None)})."""
    rng = np.random.default_rng(2)
    written = {}
    cities = {"train": {"bochum": 1, "aachen": 2}, "val": {"frankfurt": 1}}
    for split, per_city in cities.items():
        for city, n in per_city.items():
            for i in range(n):
                stem = f"{city}_{i:06d}_000019"
                h, w = (H, W) if split == "train" else (16, 24)
                image = rgb(rng, h, w)
                ids = rng.choice(CITYSCAPES_IDS, (h, w)).astype(np.uint8)
                ids[0, :4] = (7, 33, 4, 0)
                save(tmp_path / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png", image)
                gt = tmp_path / "gtFine" / split / city
                save(gt / f"{stem}_gtFine_labelIds.png", ids)
                save(gt / f"{stem}_gtFine_color.png", rgb(rng, h, w))  # other gtFine files are ignored
                train_ids = None
                if city == "bochum":  # differs from what the labelIds would give: proves it is used as is
                    train_ids = np.where(rng.random((h, w)) < 0.3, 255, rng.integers(0, 19, (h, w))).astype(np.uint8)
                    save(gt / f"{stem}_gtFine_labelTrainIds.png", train_ids)
                written[stem] = (image, ids, train_ids)
    return tmp_path, written


def gid_tile(seed: int, w=600, h=520):
    """An RGB tile and its class-index map (blocks of 40 px; 255 = black, unlabelled) and colour label."""
    rng = np.random.default_rng(seed)
    blocks = rng.choice([*range(15), 255], (h // 40 + 1, w // 40 + 1)).astype(np.uint8)
    index = np.kron(blocks, np.ones((40, 40), np.uint8))[:h, :w]
    colours = np.zeros((256, 3), np.uint8)
    colours[:15] = seg.GID_PALETTE
    return rgb(rng, h, w), index, colours[index]


@pytest.fixture
def gid_root(tmp_path):
    """GID/Fine_Image_Dataset with two 600 x 520 tiles (.tif). Returns (root, folder, {stem: (image, index)})."""
    folder = tmp_path / "GID" / "Fine_Image_Dataset"
    tiles = {}
    for k, stem in enumerate(["GF2_PMS1__L1A0000564539-MSS1", "GF2_PMS2__L1A0001787564-MSS2"]):
        image, index, label = gid_tile(10 + k)
        save(folder / "image_RGB" / f"{stem}.tif", image)
        save(folder / "label_15classes" / f"{stem}_label.tif", label)
        tiles[stem] = (image, index)
    return tmp_path, folder, tiles


# ---------------------------------------------------------------------------
# attributes, options


def test_attributes_right_after_construction(tmp_path):
    nowhere = str(tmp_path / "nowhere")  # construction does not touch the disk
    expected = [(VOC(nowhere), 21, (512, 512), 0.009), (ADE20K(nowhere), 150, (512, 512), 0.01),
                (Cityscapes(nowhere), 19, (512, 1024), 0.01), (GID(nowhere), 15, (256, 256), 0.01),
                (Blobs(size=32), 5, (32, 32), 0.01)]  # fmt: skip
    for dm, k, crop, lr in expected:
        assert isinstance(dm, SegDataModule)
        assert dm.num_classes == k and len(dm.class_names) == k and len(set(dm.class_names)) == k
        assert dm.palette.dtype == np.uint8 and dm.palette.shape == (k, 3)
        assert dm.ignore_index == 255 and dm.crop == crop and dm.lr == lr
        assert dm.mean == (0.485, 0.456, 0.406) and dm.std == (0.229, 0.224, 0.225)
        assert dm.train_set is None
    voc, ade, city, gid = (e[0] for e in expected[:4])
    assert voc.class_names[0] == "background" and voc.class_names[20] == "tvmonitor"
    assert ade.class_names[:5] == ["wall", "building", "sky", "floor", "tree"] and ade.class_names[-1] == "flag"
    assert city.class_names[0] == "road" and city.class_names[18] == "bicycle"
    assert gid.class_names[0] == "industrial land" and gid.class_names[14] == "pond"
    assert gid.palette[0].tolist() == [200, 0, 0] and gid.palette[14].tolist() == [0, 200, 250]
    assert VOC(nowhere, crop=[300, 400]).crop == (300, 400)


@pytest.mark.parametrize(
    "kwargs, option",
    [({"crop": 0}, "data.crop"), ({"crop": [1, 2, 3]}, "data.crop"), ({"scale_range": [2.0, 0.5]}, "data.scale_range"),
     ({"batch_size": 0}, "data.batch_size"), ({"eval_batch_size": 1.5}, "data.eval_batch_size"),
     ({"num_workers": -1}, "data.num_workers"), ({"on_bad_file": "ignore"}, "data.on_bad_file"),
     ({"lr": 0}, "data.lr"), ({"flip": "yes"}, "data.flip"), ({"aug": 1}, "data.aug")],
)  # fmt: skip
def test_options_are_validated(tmp_path, kwargs, option):
    with pytest.raises(UserError, match=option):
        VOC(str(tmp_path), **kwargs)


def test_messages_suggest_the_data_sets_own_defaults():
    """A data set names only its own options; the examples in messages are still the defaults it runs with."""
    cases = [(lambda: VOC("/x", batch_size=0), "data.batch_size=16"), (lambda: VOC("/x", lr=0), "data.lr=0.009"),
             (lambda: Blobs(batch_size=0), "data.batch_size=8"), (lambda: Blobs(num_workers=-1), "data.num_workers=0"),
             (lambda: GID("/x", num_workers=-1), "data.num_workers=4")]  # fmt: skip
    for make, example in cases:
        with pytest.raises(UserError, match=re.escape(example)):
            make()


def test_hyperparameters_are_the_constructor_arguments():
    """What checkpoints and loggers record: the arguments of the data set's constructor and of the base's (defaults
    filled in) as given, each once, though a data set names only its own options and passes the rest on."""
    common = {"scale_range": (0.5, 2.0), "flip": True, "batch_size": 16, "eval_batch_size": 1, "num_workers": 4,
              "on_bad_file": "error", "lr": 0.01, "seed": 0}
    assert dict(VOC("/x", aug=True, crop=[3, 4]).hparams) == {**common, "root": "/x", "aug": True, "crop": [3, 4],
                                                              "lr": 0.009}  # fmt: skip
    assert dict(ADE20K("/x", seed=2).hparams) == {**common, "root": "/x", "crop": 512, "seed": 2}
    assert dict(Cityscapes("/x", lr=0.02).hparams) == {**common, "root": "/x", "crop": (512, 1024), "lr": 0.02}
    assert dict(GID("/x", 128).hparams) == {**common, "root": "/x", "patch": 128, "split_seed": 0, "crop": 256}
    blobs = Blobs(size=32.0, flip=False).hparams  # no root: generated data
    assert dict(blobs) == {**common, "num_train": 2000, "num_val": 200, "num_test": 200, "size": 32, "crop": None,
                           "scale_range": (0.75, 1.5), "flip": False, "batch_size": 8, "eval_batch_size": 8,
                           "num_workers": 0, "pretrained": False}  # fmt: skip
    assert type(blobs["size"]) is int


STRIPE_MASKS = np.repeat(np.repeat([[0, 1]], 4, axis=1), 8, axis=0)[None].repeat(6, axis=0).astype(np.uint8)


class Stripes(SegDataModule):
    """A data set written as :mod:`datamodules.segmentation.base` says: its name, classes, colours and sources."""

    name = "stripes"
    class_names = ["dark", "light"]
    palette = np.array([(0, 0, 0), (255, 255, 255)], np.uint8)

    def _sources(self):
        images = np.repeat(STRIPE_MASKS[..., None] * 255, 3, axis=-1)  # (6, 8, 8, 3)
        source = ArraySource(images, STRIPE_MASKS, np.arange(6), [f"stripes {i}" for i in range(6)])
        return {"train": source, "val": source, "test": source}


def test_a_new_data_set_is_its_declarations():
    dm = Stripes(None, crop=8, batch_size=4, eval_batch_size=3, num_workers=0)
    assert dm.num_classes == 2 and dm.class_names == ["dark", "light"] and dm.palette.tolist() == [[0] * 3, [255] * 3]
    dm.palette[0] = 9
    dm.class_names.append("grey")
    assert Stripes.palette[0].tolist() == [0, 0, 0] and len(Stripes.class_names) == 2  # instances hold copies
    assert dict(dm.hparams) == {"crop": 8, "scale_range": (0.5, 2.0), "flip": True, "batch_size": 4,
                                "eval_batch_size": 3, "num_workers": 0, "on_bad_file": "error", "lr": 0.01, "seed": 0}
    loader = dm.train_dataloader()
    assert len(loader) == 1 and first_batch(loader)["image"].shape == (4, 3, 8, 8)  # 6 samples: last batch dropped
    val = first_batch(dm.val_dataloader())
    np.testing.assert_array_equal(val["mask"].numpy(), STRIPE_MASKS[:3])
    np.testing.assert_allclose(pixels(val["image"])[:, 0].numpy(), STRIPE_MASKS[:3] * 255.0, atol=1e-3)
    with pytest.raises(UserError, match=r"data\.crop must be"):
        Stripes(None, crop=0)
    with pytest.raises(UserError, match=r"The stripes training split has 6 samples, fewer than one batch of "
                                        r"data\.batch_size=8"):
        Stripes(None, batch_size=8, num_workers=0).train_dataloader()


# ---------------------------------------------------------------------------
# VOC


def test_voc_labels_batches_and_normalisation(voc_root):
    root, masks = voc_root
    dm = VOC(str(root), crop=16, batch_size=2, eval_batch_size=1, num_workers=0)
    dm.setup()
    assert len(dm.train_set) == 3 and len(dm.val_set) == 2 and dm.test_set is dm.val_set
    folder = root / "VOCdevkit" / "VOC2012"
    for i, id_ in enumerate(["2007_000033", "2007_000011"]):  # val.txt order
        sample = dm.val_set[i]
        assert sample["mask"].dtype == torch.int64
        np.testing.assert_array_equal(sample["mask"].numpy(), masks[id_])  # palette indices, 255 kept
        jpeg = decoded(folder / "JPEGImages" / f"{id_}.jpg")
        assert sample["image"].dtype == torch.float32 and sample["image"].shape == (3, *jpeg.shape[:2])
        np.testing.assert_allclose(pixels(sample["image"]).permute(1, 2, 0).numpy(), jpeg, atol=1e-3)
    batch = first_batch(dm.val_dataloader())
    assert batch["image"].shape == (1, 3, H, W) and batch["mask"].shape == (1, H, W)
    loader = dm.train_dataloader()
    assert loader.drop_last and loader.pin_memory == torch.cuda.is_available() and not loader.persistent_workers
    assert len(loader) == 1  # 3 samples, batches of 2, last dropped
    batch = first_batch(loader)
    assert batch["image"].dtype == torch.float32 and batch["image"].shape == (2, 3, 16, 16)
    assert batch["mask"].dtype == torch.int64 and batch["mask"].shape == (2, 16, 16)
    values = set(batch["mask"].unique().tolist())
    assert values <= set(range(21)) | {255}


def test_eval_batches_are_padded(voc_root):
    root, masks = voc_root
    dm = VOC(str(root), eval_batch_size=2, num_workers=0)
    batch = first_batch(dm.val_dataloader())
    assert batch["image"].shape == (2, 3, H, W) and batch["mask"].shape == (2, H, W)
    small = batch["mask"][1]  # 2007_000011 is 20 x 28, padded at the bottom / right
    np.testing.assert_array_equal(small[:20, :28].numpy(), masks["2007_000011"])
    assert (small[20:] == 255).all() and (small[:, 28:] == 255).all()
    padding = pixels(batch["image"][1])
    assert padding[:, 20:].abs().max() < 1e-3 and padding[:, :, 28:].abs().max() < 1e-3  # black


def test_voc_aug_uses_trainaug_and_sbd_masks(voc_root):
    root, masks = voc_root
    dm = VOC(str(root), aug=True)
    dm.setup()
    pairs = dm.train_set.source.pairs
    assert [p[0].stem for p in pairs] == ["2007_000032", "2008_000002", "2008_000003", "2008_000004"]
    assert all(p[1].parent.name == "SegmentationClassAug" for p in pairs)
    assert all(p[1].parent.name == "SegmentationClass" for p in dm.val_set.source.pairs)
    image, mask = dm.train_set.source.load(1)
    np.testing.assert_array_equal(mask, masks["aug/2008_000002"])
    np.testing.assert_array_equal(dm.val_set.source.load(0)[1], masks["2007_000033"])


def test_voc_missing_files_and_split_lists(voc_root, caplog):
    root, _ = voc_root
    folder = root / "VOCdevkit" / "VOC2012"
    (folder / "JPEGImages" / "2007_000039.jpg").unlink()  # mask without image
    (folder / "SegmentationClass" / "2007_000063.png").unlink()  # image without mask
    with pytest.raises(UserError, match=r"2007_000039\.png: mask without image.*2 such problems.*on_bad_file=skip"):
        VOC(str(root)).setup()
    dm = VOC(str(root), on_bad_file="skip", batch_size=1)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.train_set) == 1 and len(dm.skipped) == 2
    assert "Skipped 2" in caplog.text and "2007_000039.png" in caplog.text and "2007_000063.jpg" in caplog.text
    (folder / "ImageSets" / "Segmentation" / "val.txt").unlink()
    with pytest.raises(UserError, match=r"Split file .*val\.txt does not exist.*JPEGImages"):
        VOC(str(root), on_bad_file="skip").setup()
    (folder / "ImageSets" / "Segmentation" / "trainaug.txt").unlink()
    with pytest.raises(UserError, match=r"trainaug\.txt does not exist"):
        VOC(str(root), aug=True).setup()


def test_missing_dataset_roots_show_the_layout(tmp_path):
    cases = [(VOC, r"VOCdevkit/VOC2012/ with JPEGImages/<id>\.jpg.*host\.robots\.ox\.ac\.uk"),
             (ADE20K, r"ADEChallengeData2016/ with images/\{training,validation\}.*ADEChallengeData2016\.zip"),
             (Cityscapes, r"leftImg8bit/\{train,val\}/<city>/<stem>_leftImg8bit\.png.*cityscapes-dataset\.com"),
             (GID, r"Accepted layouts: <root>/GID/Fine_Image_Dataset/image_RGB.*directly in <root>/GID/")]  # fmt: skip
    for cls, message in cases:
        dm = cls(str(tmp_path / "nowhere"))
        with pytest.raises(UserError, match=f"does not exist.*{message}"):
            dm.prepare_data()
        with pytest.raises(UserError, match=message):
            dm.setup()
    (tmp_path / "ADEChallengeData2016" / "images" / "training").mkdir(parents=True)
    (tmp_path / "ADEChallengeData2016" / "annotations").mkdir(parents=True)
    with pytest.raises(UserError, match=r"lacks some of .*annotations/validation"):
        ADE20K(str(tmp_path)).setup()
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (tmp_path / "VOCdevkit" / "VOC2012" / sub).mkdir(parents=True)
    with pytest.raises(UserError, match=r"data.aug=true needs .*SegmentationClassAug"):
        VOC(str(tmp_path), aug=True).setup()


@pytest.mark.parametrize("cls, folder, fixture", [
    (Cityscapes, "leftImg8bit/train", "cityscapes_root"),
    (ADE20K, "ADEChallengeData2016/images/training", "ade_root"),
    (VOC, "VOCdevkit/VOC2012/SegmentationClass", "voc_root"),
])  # fmt: skip
def test_a_layout_folder_that_is_a_file_is_named(cls, folder, fixture, request):
    """A split folder that is a file (a stray download, an archive not unpacked) ended in a bare NotADirectoryError."""
    root, _ = request.getfixturevalue(fixture)
    path = root / folder
    shutil.rmtree(path)
    path.write_text("x")
    with pytest.raises(UserError, match=f"{re.escape(str(path))} is a file, not a folder") as err:
        cls(str(root)).setup()
    assert "\n" not in str(err.value)


def test_a_gid_folder_that_is_a_file_is_named(tmp_path):
    (tmp_path / "GID" / "label_15classes").mkdir(parents=True)
    (tmp_path / "GID" / "image_RGB").write_text("x")
    with pytest.raises(UserError, match=r"GID/image_RGB is a file, not a folder.*Accepted layouts"):
        GID(str(tmp_path)).setup()


# ---------------------------------------------------------------------------
# ADE20K


def test_ade20k_label_mapping(ade_root):
    root, masks = ade_root
    dm = ADE20K(str(root))
    dm.setup()
    assert len(dm.train_set) == 3 and len(dm.val_set) == 2 and dm.test_set is dm.val_set
    raw = masks["ADE_val_00000001"]
    mask = dm.val_set[0]["mask"].numpy()
    np.testing.assert_array_equal(mask[raw == 0], 255)
    np.testing.assert_array_equal(mask[raw > 0], raw[raw > 0].astype(np.int64) - 1)
    assert mask[0, :3].tolist() == [255, 149, 0]


def test_ade20k_unpaired_files(ade_root, caplog):
    root, _ = ade_root
    folder = root / "ADEChallengeData2016"
    (folder / "annotations" / "training" / "ADE_train_00000002.png").unlink()
    save(folder / "annotations" / "validation" / "ADE_val_00000009.png", np.zeros((H, W), np.uint8))
    with pytest.raises(UserError, match=r"ADE_train_00000002\.jpg: image without mask"):
        ADE20K(str(root)).setup()
    dm = ADE20K(str(root), on_bad_file="skip")
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.train_set) == 2 and len(dm.val_set) == 2 and len(dm.skipped) == 2
    assert caplog.text.count("Skipped 1") == 2 and "ADE_val_00000009.png" in caplog.text


def test_bad_headers_are_setup_problems_and_bad_pixels_raise_when_loaded(ade_root, caplog):
    root, _ = ade_root
    train = root / "ADEChallengeData2016" / "annotations" / "training"
    save(train / "ADE_train_00000001.png", np.full((H, W), 151, np.uint8))  # out of range: found when loaded
    save(train / "ADE_train_00000002.png", np.zeros((H + 1, W), np.uint8))  # size mismatch: header
    (root / "ADEChallengeData2016" / "images" / "training" / "ADE_train_00000003.jpg").write_bytes(b"not a jpeg")
    save(train.parent / "validation" / "ADE_val_00000001.png", np.zeros((H, W, 3), np.uint8))  # RGB, not indices
    with pytest.raises(UserError, match=r"ADE_train_00000002\.jpg: is 32x24 .*/ADE_train_00000002\.png is 32x25.*"
                                        r"2 such problems.*on_bad_file=skip"):
        ADE20K(str(root)).setup()
    dm = ADE20K(str(root), on_bad_file="skip")
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.skipped) == 3 and "Skipped 2" in caplog.text and "Skipped 1" in caplog.text
    assert "ADE_train_00000003.jpg: cannot be opened as an image" in dm.skipped[1]
    assert "ADE_val_00000001.png: is a RGB image" in dm.skipped[2]
    with pytest.raises(UserError, match=r"ADE_train_00000001\.png has label value\(s\) 151; expected 0\.\.150"):
        dm.train_set[0]  # found only when loaded: raised even with skip
    assert len(dm.val_set) == 1 and dm.val_set[0]["mask"].shape == (H, W)


def test_truncated_mask_is_named(voc_root):
    root, _ = voc_root
    path = root / "VOCdevkit" / "VOC2012" / "SegmentationClass" / "2007_000033.png"
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"IDAT") + 8])  # the header intact (setup passes), the pixels cut
    dm = VOC(str(root), num_workers=1)  # the error crosses the worker boundary
    dm.setup()
    with pytest.raises(UserError, match=r"2007_000033\.png cannot be decoded as a mask"):
        next(iter(dm.val_dataloader()))


# ---------------------------------------------------------------------------
# Cityscapes


def test_cityscapes_label_ids_and_train_ids(cityscapes_root):
    root, written = cityscapes_root
    dm = Cityscapes(str(root), crop=[16, 16])
    dm.setup()
    assert dm.crop == (16, 16) and dm.test_set is dm.val_set
    pairs = dm.train_set.source.pairs
    assert [p[0].name for p in pairs] == ["aachen_000000_000019_leftImg8bit.png",
                                          "aachen_000001_000019_leftImg8bit.png",
                                          "bochum_000000_000019_leftImg8bit.png"]  # fmt: skip
    assert pairs[2][1].name.endswith("_gtFine_labelTrainIds.png") and pairs[0][1].name.endswith("_labelIds.png")
    table = np.full(256, 255, np.int64)
    for label_id, train_id in {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11,
                               25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}.items():  # fmt: skip
        table[label_id] = train_id
    image, ids, _ = written["aachen_000000_000019"]
    _, mask = dm.train_set.source.load(0)
    np.testing.assert_array_equal(mask, table[ids])
    assert mask[0, :4].tolist() == [0, 18, 255, 255]  # ids 7, 33, 4, 0
    _, mask = dm.train_set.source.load(2)
    np.testing.assert_array_equal(mask, written["bochum_000000_000019"][2])  # labelTrainIds as is
    sample = dm.val_set[0]
    image, ids, _ = written["frankfurt_000000_000019"]
    np.testing.assert_array_equal(sample["mask"].numpy(), table[ids])
    np.testing.assert_allclose(pixels(sample["image"]).permute(1, 2, 0).numpy(), image, atol=1e-3)


def test_cityscapes_train_ids_named_label_ids_are_refused(cityscapes_root):
    """Official labelIds hold ids 0..33 only. A train-id mask (0..18 and 255) saved under the labelIds name was
    mapped a second time without a word: 7 (traffic light) became road, road became ignored (68% of the pixels of
    the issue's file). It is refused, naming the file, the values above 33 and the likely cause."""
    root, written = cityscapes_root
    stem = "frankfurt_000000_000019"
    train_ids = np.where(np.arange(16 * 24).reshape(16, 24) % 5 == 0, 255, np.arange(16 * 24).reshape(16, 24) % 19)
    path = root / "gtFine" / "val" / "frankfurt" / f"{stem}_gtFine_labelIds.png"
    save(path, train_ids.astype(np.uint8))
    dm = Cityscapes(str(root), crop=[16, 16])
    dm.setup()
    with pytest.raises(UserError) as err:
        dm.val_set[0]
    message = str(err.value)
    for needle in (str(path), "value(s) 255", "0..33", "_gtFine_labelTrainIds.png"):
        assert needle in message, (needle, message)
    assert "\n" not in message
    ids = written[stem][1]
    ids[0, 0] = 33  # the largest official id still loads
    save(path, ids)
    assert dm.val_set[0]["mask"][0, 0] == 18


def test_cityscapes_unpaired_and_root_forms(cityscapes_root, caplog):
    root, _ = cityscapes_root
    val_images = root / "leftImg8bit" / "val" / "frankfurt"
    save(val_images / "frankfurt_000009_000019_leftImg8bit.png", np.zeros((H, W, 3), np.uint8))
    with pytest.raises(UserError, match=r"frankfurt_000009_000019_leftImg8bit\.png: image without mask"):
        Cityscapes(str(root)).setup()
    (root / "cityscapes").mkdir()
    for sub in ("leftImg8bit", "gtFine"):
        (root / sub).rename(root / "cityscapes" / sub)
    dm = Cityscapes(str(root), on_bad_file="skip")  # <root>/cityscapes/ works too
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.val_set) == 1 and "frankfurt_000009_000019_leftImg8bit.png: image without mask" in dm.skipped[0]


def test_high_bit_depth_image_is_a_setup_problem(cityscapes_root):
    """A 16-bit image (a raw export) was read as a white RGB image without a word."""
    root, _ = cityscapes_root
    path = root / "leftImg8bit" / "train" / "aachen" / "aachen_000001_000019_leftImg8bit.png"
    Image.fromarray(np.full((H, W), 30000, np.uint16)).save(path)  # PIL mode I;16
    with pytest.raises(UserError, match=r"aachen_000001_000019_leftImg8bit\.png.*PIL mode I;16.*8-bit"):
        seg.read_image(path, "Replace it.")
    with pytest.raises(UserError, match=r"aachen_000001_000019_leftImg8bit\.png: .*PIL mode I;16.*on_bad_file=skip"):
        Cityscapes(str(root)).setup()
    dm = Cityscapes(str(root), on_bad_file="skip")
    dm.setup()
    assert len(dm.train_set) == 2 and len(dm.skipped) == 1 and str(path) in dm.skipped[0]


# ---------------------------------------------------------------------------
# GID


def test_gid_patches_splits_and_colours(gid_root):
    root, folder, tiles = gid_root
    dm = GID(str(root))
    dm.setup()
    assert len(dm.patch_origin) == 2 * 4  # floor(600 / 256) * floor(520 / 256) = 4 per tile
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4, 2, 2)  # 60 / 20 / 20
    used = np.concatenate([dm.train_set.source.indices, dm.val_set.source.indices, dm.test_set.source.indices])
    assert sorted(used.tolist()) == list(range(8))
    stems = sorted(tiles)
    assert dm.tile_names == [f"{s}.tif" for s in stems]
    for split in (dm.train_set, dm.val_set, dm.test_set):
        for i, row in enumerate(split.source.indices):
            t, r, c = dm.patch_origin[row]
            image, index = tiles[stems[t]]
            window = np.s_[r * 256 : (r + 1) * 256, c * 256 : (c + 1) * 256]
            got_image, got_mask = split.source.load(i)
            np.testing.assert_array_equal(got_image, image[window])
            np.testing.assert_array_equal(got_mask, index[window])  # colour -> index, black -> 255
    assert {int(v) for v in np.unique(dm.val_set.source.masks)} <= set(range(15)) | {255}
    assert (dm.val_set.source.masks == 255).any()
    caches = list((root / "GID" / "processed").glob("patches_256_*.npz"))
    assert len(caches) == 1 and len(caches[0].name) == len("patches_256_") + 16 + len(".npz")
    again = GID(str(root), split_seed=0)
    again.setup()
    assert np.array_equal(again.train_set.source.indices, dm.train_set.source.indices)
    other = GID(str(root), split_seed=1)
    other.setup()
    assert not np.array_equal(other.train_set.source.indices, dm.train_set.source.indices)
    batch = first_batch(GID(str(root), crop=64, batch_size=2, eval_batch_size=2, num_workers=0).train_dataloader())
    assert batch["image"].shape == (2, 3, 64, 64) and batch["mask"].shape == (2, 64, 64)


def test_gid_cache_is_reused_and_rebuilt_when_stale(gid_root, monkeypatch):
    root, folder, _ = gid_root
    GID(str(root)).prepare_data()
    (cache,) = (root / "GID" / "processed").glob("*.npz")
    monkeypatch.setattr("datamodules.segmentation.gid.read_image",
                        lambda *a: pytest.fail("decoded a tile despite the cache"))
    dm = GID(str(root))
    dm.setup()
    assert len(dm.train_set) == 4
    monkeypatch.undo()
    tile = next((folder / "image_RGB").iterdir())
    os.utime(tile, ns=(tile.stat().st_atime_ns, tile.stat().st_mtime_ns + 10**9))
    GID(str(root)).setup()
    (rebuilt,) = (root / "GID" / "processed").glob("*.npz")
    assert rebuilt != cache  # the stale cache was replaced
    assert not list((root / "GID" / "processed").glob("*.tmp"))


def test_gid_cache_of_an_unwritable_data_folder(gid_root, unwritable, monkeypatch):
    """The patch cache of a read-only GID folder goes to the user's cache folder, found again by prepare_data and
    setup: the tiles are cut once."""
    root, _, _ = gid_root
    user_cache = unwritable(root)
    calls = []
    real = seg.gid.read_image
    monkeypatch.setattr("datamodules.segmentation.gid.read_image", lambda *a: calls.append(a[0]) or real(*a))
    GID(str(root)).prepare_data()
    assert len(calls) == 4 and not list(root.rglob("*.npz")) and len(list(user_cache.rglob("*.npz"))) == 1
    dm = GID(str(root))
    dm.prepare_data()
    dm.setup()
    assert len(calls) == 4 and len(dm.train_set) == 4


def test_gid_bad_tiles(gid_root, caplog):
    root, folder, tiles = gid_root
    stem = sorted(tiles)[1]
    _, _, label = gid_tile(11)
    label[300, 100] = (1, 2, 3)
    save(folder / "label_15classes" / f"{stem}_label.tif", label)
    with pytest.raises(UserError, match=rf"{stem}_label\.tif has colour \(1, 2, 3\) at row 300, column 100"):
        GID(str(root)).setup()
    dm = GID(str(root), on_bad_file="skip")
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.patch_origin) == 4 and (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (2, 1, 1)
    assert "Skipped 1 bad tile(s) of gid" in caplog.text and len(dm.skipped) == 1
    assert dm.skipped[0].startswith(f"{folder / 'image_RGB' / stem}.tif: ") and "has colour (1, 2, 3)" in dm.skipped[0]
    with pytest.raises(UserError, match=r"has colour \(1, 2, 3\).*on_bad_file=skip"):
        GID(str(root)).setup()  # the cache remembers the skipped tile
    save(folder / "label_15classes" / "orphan_label.png", np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(UserError, match=r"orphan_label\.png: label without image"):
        GID(str(root)).setup()


def test_gid_flat_layout_with_png(tmp_path):
    image, index, label = gid_tile(3, w=300, h=600)
    save(tmp_path / "GID" / "image_RGB" / "tile.png", image)
    save(tmp_path / "GID" / "label_15classes" / "tile_label.png", label)
    dm = GID(str(tmp_path), patch=128)
    dm.setup()
    assert len(dm.patch_origin) == 2 * 4 and sorted(dm.patch_origin[:, 1].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list((tmp_path / "GID" / "processed").glob("patches_128_*.npz"))


# ---------------------------------------------------------------------------
# training transforms


def column_sample(h=H, w=W):
    """A (3, h, w) image whose red channel encodes the class (column // 8) * 60 and green the column."""
    cols = np.arange(w)
    mask = np.broadcast_to(cols // 8, (h, w)).astype(np.uint8)
    image = np.zeros((h, w, 3), np.uint8)
    image[..., 0] = mask * 60
    image[..., 1] = cols * 8
    return image, mask


def test_crop_pads_with_ignore_and_black():
    image, mask = column_sample()
    source = ArraySource(image[None], mask[None], [0], ["column"])
    dataset = SegmentationDataset(source, TrainTransform((40, 48), (0.5, 0.5), flip=False))
    torch.manual_seed(0)
    sample = dataset[0]
    assert sample["image"].shape == (3, 40, 48) and sample["mask"].shape == (40, 48)
    y, x = pixels(sample["image"]), sample["mask"]
    assert (x[12:] == 255).all() and (x[:, 16:] == 255).all()  # 24 x 32 scaled to 12 x 16, then padded
    assert y[:, 12:].abs().max() < 1e-3 and y[:, :, 16:].abs().max() < 1e-3
    assert set(x[:12, :16].unique().tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_flip_and_scale_keep_image_and_mask_aligned(scale):
    image, mask = column_sample()
    source = ArraySource(image[None], mask[None], [0], ["column"])
    dataset = SegmentationDataset(source, TrainTransform((24, 32), (scale, scale), flip=True))
    flipped = []
    for seed in range(12):
        torch.manual_seed(seed)
        sample = dataset[0]
        red, green = pixels(sample["image"])[0], pixels(sample["image"])[1]
        flipped.append(bool(green[0, 0] > green[0, -1]))
        exact = (red - (red / 60).round() * 60).abs() < 0.5  # not blended across a class boundary
        assert exact.float().mean() > 0.8
        assert torch.equal(sample["mask"][exact], (red[exact] / 60).round().long())
    assert any(flipped) and not all(flipped)


def test_training_samples_are_reproducible(voc_root):
    root, _ = voc_root
    dm = VOC(str(root), crop=16, batch_size=2)
    dm.setup()
    torch.manual_seed(1)
    a = dm.train_set[0]
    torch.manual_seed(1)
    b = dm.train_set[0]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
    torch.manual_seed(2)
    assert not torch.equal(dm.train_set[0]["image"], a["image"])
    workers = VOC(str(root), crop=16, batch_size=2, num_workers=1)
    # The loader's shuffles and worker seeds are fixed by the seed when it is made (and the epoch).
    L.seed_everything(5, verbose=False)
    one = next(iter(workers.train_dataloader()))
    L.seed_everything(5, verbose=False)
    two = next(iter(workers.train_dataloader()))
    assert torch.equal(one["image"], two["image"]) and torch.equal(one["mask"], two["mask"])


def test_pad_collate_fills_black_and_ignore():
    a = {"image": torch.ones(3, 2, 3), "mask": torch.zeros(2, 3, dtype=torch.int64)}
    b = {"image": torch.ones(3, 4, 2), "mask": torch.ones(4, 2, dtype=torch.int64)}
    batch = PadCollate()([a, b])
    assert batch["image"].shape == (2, 3, 4, 3) and batch["mask"].shape == (2, 4, 3)
    assert (batch["mask"][0, 2:] == 255).all() and (batch["mask"][1, :, 2:] == 255).all()
    assert pixels(batch["image"][0, :, 2:]).abs().max() < 1e-4 and (batch["image"][0, :, :2, :3] == 1).all()


# ---------------------------------------------------------------------------
# Blobs


def test_blobs_deterministic_balanced_batches():
    dm = Blobs(num_train=16, num_val=8, num_test=8, size=48, batch_size=4, eval_batch_size=4)
    dm.setup()
    src = dm.train_set.source
    assert src.images.dtype == np.uint8 and src.images.shape == (16, 48, 48, 3) and src.masks.shape == (16, 48, 48)
    assert set(np.unique(src.masks).tolist()) == set(range(5))  # every class present
    assert (src.masks == 0).mean() < 0.95 and all((src.masks == c).mean() > 0.01 for c in range(1, 5))
    again = Blobs(num_train=8, num_val=8, num_test=8, size=48)
    again.setup()
    np.testing.assert_array_equal(again.train_set.source.images, src.images[:8])  # independent of split sizes
    np.testing.assert_array_equal(again.test_set.source.masks, dm.test_set.source.masks)
    other = Blobs(num_train=8, num_val=8, num_test=8, size=48, seed=1)
    other.setup()
    assert not np.array_equal(other.train_set.source.images, again.train_set.source.images)
    assert not np.array_equal(dm.val_set.source.images, dm.test_set.source.images)
    train = first_batch(dm.train_dataloader())
    assert train["image"].shape == (4, 3, 48, 48) and train["mask"].shape == (4, 48, 48)
    val = first_batch(dm.val_dataloader())
    assert val["image"].shape == (4, 3, 48, 48) and val["mask"].dtype == torch.int64
    np.testing.assert_array_equal(val["mask"].numpy(), dm.val_set.source.masks[:4])
    with pytest.raises(UserError, match="data.batch_size"):
        Blobs(num_train=2, num_val=1, num_test=1, size=16, batch_size=4).train_dataloader()


# ---------------------------------------------------------------------------
# Hydra configs


DATA_CONFIGS = {"voc": VOC, "ade20k": ADE20K, "cityscapes": Cityscapes, "gid": GID, "blobs": Blobs}


def option_default(cls: type, option: str):
    """The default of ``option`` in the most derived constructor that names it (a data set passes the rest on)."""
    for klass in cls.__mro__:
        parameter = inspect.signature(klass.__init__).parameters.get(option)
        if parameter is not None:
            return parameter.default
    raise AssertionError(f"{cls.__name__} takes no option {option!r}")


@pytest.mark.parametrize("name", DATA_CONFIGS)
def test_yaml_values_are_the_class_defaults(name):
    """``configs/data/<name>.yaml`` lists the options (a key must be there for ``data.<key>=`` to override it) and the
    constructors default them (for library users): every value the yaml states is the class's default."""
    cfg = OmegaConf.to_container(OmegaConf.load(Path("configs") / "data" / f"{name}.yaml"))  # unresolved
    assert get_class(cfg.pop("_target_")) is DATA_CONFIGS[name]
    for key, value in cfg.items():
        default = option_default(DATA_CONFIGS[name], key)
        if isinstance(value, str) and value.startswith("${"):  # root, seed: from the run's config
            continue
        assert value == (list(default) if isinstance(default, tuple) else default), f"{name}.yaml: {key}"


def compose_data(overrides):
    with initialize_config_dir(config_dir=str(Path("configs").resolve()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return cfg, instantiate(cfg.data)


def test_configs_compose_and_instantiate(tmp_path):
    cfg, dm = compose_data(["data=blobs", "data.num_train=8", "data.num_val=2", "data.num_test=2"])
    assert type(dm) is Blobs and dm.seed == cfg.seed and dm.crop == (64, 64) and dm.size == 64
    assert dm.batch_size == 8 and dm.eval_batch_size == 8 and dm.num_workers == 0
    assert dm.scale_range == (0.75, 1.5) and dm.flip and dm.lr == 0.01 and cfg.data.pretrained is False
    dm.setup()
    assert len(dm.train_set) == 8
    expected = {"voc": (VOC, (512, 512), 0.009, str(tmp_path)), "ade20k": (ADE20K, (512, 512), 0.01, str(tmp_path)),
                "cityscapes": (Cityscapes, (512, 1024), 0.01, str(tmp_path / "cityscapes")),
                "gid": (GID, (256, 256), 0.01, str(tmp_path))}  # fmt: skip
    for name, (cls, crop, lr, root) in expected.items():
        cfg, dm = compose_data([f"data={name}", f"data_dir={tmp_path}"])
        assert type(dm) is cls and dm.root == root and dm.crop == crop and dm.lr == lr
        assert dm.batch_size == 16 and dm.eval_batch_size == 1 and dm.num_workers == 4
        assert dm.scale_range == (0.5, 2.0) and dm.on_bad_file == "error" and dm.seed == cfg.seed
    _, dm = compose_data(["data=cityscapes", "data.crop=769"])
    assert dm.crop == (769, 769)
    _, dm = compose_data(["data=voc", "data.aug=true"])
    assert dm.aug
