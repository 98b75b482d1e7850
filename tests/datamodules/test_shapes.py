"""The generated Shapes data set and data module."""

import lightning as L
import numpy as np
import pytest
import torch

from attention.errors import UserError
from datamodules import Shapes
from datamodules.points.shapes import SHAPE_NAMES, generate_shapes


def small(**kwargs):
    options = dict(num_classes=4, train_per_class=5, val_per_class=2, test_per_class=3, npoints=64)
    return Shapes(**{**options, **kwargs})


def test_every_shape_is_finite_centred_and_in_the_unit_sphere():
    points, labels = generate_shapes(len(SHAPE_NAMES), 8, 200, 0.01, seed=0, split="train")
    assert points.shape == (8 * len(SHAPE_NAMES), 200, 3) and points.dtype == np.float32
    assert labels.dtype == np.int64 and np.bincount(labels).tolist() == [8] * len(SHAPE_NAMES)
    assert np.isfinite(points).all()
    norms = np.linalg.norm(points, axis=-1)
    assert norms.max() <= 1 + 1e-5
    np.testing.assert_allclose(norms.max(axis=1), 1, atol=1e-5)  # farthest point on the sphere
    np.testing.assert_allclose(points.mean(axis=1), 0, atol=1e-5)


def test_generation_is_deterministic_per_seed_and_split():
    a = generate_shapes(10, 4, 128, 0.01, seed=3, split="train")
    b = generate_shapes(10, 4, 128, 0.01, seed=3, split="train")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    other_seed = generate_shapes(10, 4, 128, 0.01, seed=4, split="train")[0]
    test_split = generate_shapes(10, 4, 128, 0.01, seed=3, split="test")[0]
    for other in (other_seed, test_split):
        assert not np.isclose(a[0], other).all(axis=(1, 2)).any()  # no shared sample
    # a class's samples do not depend on how many classes are generated
    np.testing.assert_array_equal(generate_shapes(3, 4, 128, 0.01, seed=3, split="train")[0], a[0][:12])


def test_data_module_splits_and_contract():
    dm = small(batch_size=4)
    assert dm.num_classes == 4 and dm.class_names == SHAPE_NAMES[:4] == ["sphere", "cube", "cylinder", "cone"]
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (20, 8, 12)
    for ds, per_class in ((dm.train_set, 5), (dm.val_set, 2), (dm.test_set, 3)):
        assert np.bincount(ds.labels).tolist() == [per_class] * 4

    expected = generate_shapes(4, 3, 64, 0.01, seed=0, split="test")[0]
    test = list(dm.test_dataloader())
    assert [len(b["label"]) for b in test] == [4, 4, 4]
    points = torch.cat([b["points"] for b in test])
    assert points.dtype == torch.float32 and test[0]["label"].dtype == torch.int64
    np.testing.assert_array_equal(points.numpy(), expected)  # eval: unaugmented, in order

    train = next(iter(dm.train_dataloader()))
    assert train["points"].shape == (4, 64, 3) and train["label"].shape == (4,)
    assert len(list(dm.train_dataloader())) == 5


def test_train_augmentation_and_seeded_batches():
    runs = []
    for _ in range(2):
        L.seed_everything(11, workers=True)
        dm = small(batch_size=8)
        dm.setup()
        runs.append([(b["points"], b["label"]) for b in dm.train_dataloader()])
    for (pa, la), (pb, lb) in zip(*runs):
        assert torch.equal(pa, pb) and torch.equal(la, lb)
    clean = generate_shapes(4, 5, 64, 0.01, seed=0, split="train")[0]
    sample = dm.train_set[0]["points"].numpy()
    assert not np.array_equal(sample, clean[0])
    np.testing.assert_array_equal(dm.train_set.source._points, clean)  # cache untouched


def test_val_per_class_zero_follows_val_fraction():
    dm = small(val_per_class=0)
    dm.setup()
    assert dm.val_set is dm.test_set
    dm = small(val_per_class=0, val_fraction=0.25)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (15, 5)
    assert not dm.val_set.augment


def test_tiny_train_set_still_trains():
    dm = small(num_classes=3, train_per_class=1, batch_size=32)
    dm.setup()
    assert [len(b["label"]) for b in dm.train_dataloader()] == [3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_classes=len(SHAPE_NAMES) + 1), "num_classes"),
        (dict(num_classes=0), "num_classes"),
        (dict(train_per_class=0), "train_per_class"),
        (dict(val_fraction=0.2), "val_fraction"),
        (dict(noise=-0.1), "noise"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(UserError, match=match):
        small(**kwargs)


def rotation_invariant_features(points):
    """Histograms of distances to the centroid and of pairwise distances, (m, 32)."""
    radial = np.linalg.norm(points - points.mean(axis=1, keepdims=True), axis=-1)  # (m, n)
    sub = points[:, :96]
    pairwise = np.linalg.norm(sub[:, :, None] - sub[:, None], axis=-1).reshape(len(points), -1)  # (m, 96*96)
    hist = lambda x, top: np.stack([np.histogram(r, bins=16, range=(0, top))[0] / r.size for r in x])  # noqa: E731
    return np.hstack([hist(radial, 1.0), hist(pairwise, 2.0)])


@pytest.mark.parametrize("num_classes", [10, len(SHAPE_NAMES)])
def test_classes_are_separable_by_geometry(num_classes):
    """Nearest centroid on rotation-invariant histograms: guards the demo's accuracy target."""
    train, train_y = generate_shapes(num_classes, 20, 256, 0.01, seed=0, split="train")
    test, test_y = generate_shapes(num_classes, 15, 256, 0.01, seed=0, split="test")
    f_train, f_test = rotation_invariant_features(train), rotation_invariant_features(test)
    mean, std = f_train.mean(axis=0), f_train.std(axis=0) + 1e-6
    f_train, f_test = (f_train - mean) / std, (f_test - mean) / std
    centroids = np.stack([f_train[train_y == c].mean(axis=0) for c in range(num_classes)])
    predicted = np.argmin(((f_test[:, None] - centroids[None]) ** 2).sum(axis=-1), axis=1)  # (m, C) -> (m,)
    accuracy = (predicted == test_y).mean()
    assert accuracy > 0.8, f"nearest-centroid accuracy {accuracy:.2f} on {num_classes} classes"
    per_class = [(predicted[test_y == c] == c).mean() for c in range(num_classes)]
    assert min(per_class) > 0.3, dict(zip(SHAPE_NAMES, per_class))
