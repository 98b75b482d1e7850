"""The generated Parts data set and data module."""

import lightning as L
import numpy as np
import pytest
import torch

from attention.errors import UserError
from datamodules import Parts
from datamodules.partseg.parts import CATEGORIES, CATEGORY_NAMES, generate_parts


def small(**kwargs):
    options = dict(train_per_category=6, val_per_category=2, test_per_category=3, npoints=256)
    return Parts(**{**options, **kwargs})


def shapes(source):
    return [source.shape(i) for i in range(len(source))]


def test_categories_and_parts_right_after_construction():
    dm = Parts()
    assert dm.num_categories == 4 and dm.num_parts == 12
    assert dm.category_names == ["airplane", "lamp", "rocket", "table"] == CATEGORY_NAMES[:4]
    assert dm.category_parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]]
    assert dm.part_names[:5] == ["airplane/fuselage", "airplane/wing", "airplane/tail", "airplane/engine", "lamp/base"]
    everything = Parts(num_categories=len(CATEGORY_NAMES))
    assert everything.num_parts == sum(len(CATEGORIES[c][0]) for c in CATEGORY_NAMES) == 18
    assert sum(everything.category_parts, []) == list(range(18))  # contiguous, in category order
    assert all(2 <= len(p) <= 4 for p in everything.category_parts)


def test_every_shape_is_normalised_has_every_part_and_unit_normals():
    source = generate_parts(6, 5, 300, 0.005, seed=0, split="train", rotation="so3")
    dm = Parts(num_categories=6)
    assert source.points.dtype == np.float32 and source.normals.dtype == np.float32
    assert np.bincount(source.categories).tolist() == [5] * 6
    for i, (points, parts, normals) in enumerate(shapes(source)):
        assert points.shape == (300, 3) and parts.shape == (300,) and normals.shape == (300, 3)
        assert np.isfinite(points).all()
        np.testing.assert_allclose(points.mean(axis=0), 0, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(points, axis=1).max(), 1, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(normals, axis=1), 1, atol=1e-5)
        assert sorted(set(parts.tolist())) == dm.category_parts[source.categories[i]]


def test_normals_are_perpendicular_to_the_sampled_surfaces():
    """Without noise, the smallest principal axis of each point's neighbourhood is (close to) its normal."""
    source = generate_parts(6, 1, 16384, 0.0, seed=1, split="test")  # dense: thin plates need it
    for points, parts, normals in shapes(source):
        p = points[::64]  # 256 query points, neighbours among all
        dist = np.linalg.norm(p[:, None] - points[None], axis=-1)
        neighbours = points[np.argpartition(dist, 8, axis=1)[:, :8]]  # (256, 8, 3)
        centred = neighbours - neighbours.mean(axis=1, keepdims=True)
        _, _, vt = np.linalg.svd(centred)
        assert (np.abs((vt[:, 2] * normals[::64]).sum(axis=1)) > 0.8).mean() > 0.85


def test_generation_is_deterministic_per_seed_and_split():
    a = generate_parts(4, 3, 128, 0.005, seed=3, split="train")
    b = generate_parts(4, 3, 128, 0.005, seed=3, split="train")
    for x, y in zip((a.points, a.parts, a.normals, a.categories), (b.points, b.parts, b.normals, b.categories)):
        np.testing.assert_array_equal(x, y)
    other_seed = generate_parts(4, 3, 128, 0.005, seed=4, split="train")
    test_split = generate_parts(4, 3, 128, 0.005, seed=3, split="test")
    for other in (other_seed, test_split):
        assert not np.isclose(a.points, other.points).all(axis=1).reshape(12, 128).all(axis=1).any()
    # a category's shapes do not depend on how many categories are generated
    fewer = generate_parts(2, 3, 128, 0.005, seed=3, split="train")
    np.testing.assert_array_equal(fewer.points, a.points[: 6 * 128])


def test_a_non_learned_classifier_beats_chance():
    """5-NN on yaw-invariant per-point features (height; |coordinates| along the principal axes of
    the horizontal spread) against the training shapes' points: its balanced accuracy on the test
    parts is at least halfway from chance (1 / parts) to perfect, in every category."""
    train = generate_parts(6, 20, 256, 0.005, seed=0, split="train")
    test = generate_parts(6, 5, 256, 0.005, seed=0, split="test")

    def features(source, category):
        rows, labels = [], []
        for i in np.flatnonzero(source.categories == category):
            points, parts, _ = source.shape(i)
            xy = points[:, :2] - points[:, :2].mean(axis=0)
            axes = np.linalg.svd(xy, full_matrices=False)[2]  # (2, 2) principal horizontal axes
            rows.append(np.column_stack([points[:, 2], np.abs(xy @ axes.T)]))
            labels.append(parts)
        return np.concatenate(rows), np.concatenate(labels)

    for category, name in enumerate(CATEGORY_NAMES):
        ftrain, ytrain = features(train, category)
        ftest, ytest = features(test, category)
        dist = np.linalg.norm(ftest[:, None] - ftrain[None], axis=-1)
        votes = ytrain[np.argpartition(dist, 5, axis=1)[:, :5]]
        predicted = np.array([np.bincount(v).argmax() for v in votes])
        parts = np.unique(ytest)
        balanced = np.mean([(predicted[ytest == q] == q).mean() for q in parts])
        chance = 1 / len(parts)
        assert balanced > chance + 0.5 * (1 - chance), (name, balanced)


def test_data_module_splits_and_contract():
    dm = small(batch_size=4, normals=True)
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (24, 8, 12)
    for dataset, per_category in ((dm.train_set, 6), (dm.val_set, 2), (dm.test_set, 3)):
        assert np.bincount(dataset.categories).tolist() == [per_category] * 4
    test = list(dm.test_dataloader())
    assert [len(b["category"]) for b in test] == [4, 4, 4]
    batch = test[0]
    assert set(batch) == {"points", "parts", "category", "normals", "index"}
    assert torch.cat([b["index"] for b in test]).tolist() == list(range(12))  # which shape: the votes' key
    assert batch["points"].shape == (4, 256, 3) and batch["points"].dtype == torch.float32
    assert batch["parts"].shape == (4, 256) and batch["parts"].dtype == torch.int64
    assert batch["category"].shape == (4,) and batch["category"].dtype == torch.int64
    assert batch["normals"].shape == (4, 256, 3)
    expected = generate_parts(4, 3, 256, 0.005, seed=0, split="test")
    for i in range(12):  # eval samples: a permutation of the generated shape, parts aligned
        sample = dm.test_set[i]
        points, parts, normals = expected.shape(i)
        order = np.lexsort(points.T)
        got = np.lexsort(sample["points"].numpy().T)
        np.testing.assert_array_equal(sample["points"].numpy()[got], points[order])
        np.testing.assert_array_equal(sample["parts"].numpy()[got], parts[order])
        np.testing.assert_array_equal(sample["normals"].numpy()[got], normals[order])
    assert torch.equal(list(dm.test_dataloader())[1]["points"], test[1]["points"])  # deterministic
    L.seed_everything(0)
    train = list(dm.train_dataloader())
    assert len(train) == 6 and train[0]["points"].shape == (4, 256, 3)
    plain = small()
    plain.setup()
    assert set(plain.test_set[0]) == {"points", "parts", "category", "index"}


def test_smaller_npoints_subsamples_without_replacement():
    dm = small(npoints=64)
    dm.setup()
    assert dm.test_set[0]["points"].shape == (64, 3)
    assert len(torch.unique(dm.test_set[0]["points"], dim=0)) == 64


def test_val_per_category_zero_validates_on_test():
    dm = small(val_per_category=0)
    dm.setup()
    assert dm.val_set is dm.test_set


def test_default_generation_sizes():
    """The default splits (generation time is `make bench`'s business, never a timed unit test's: the CI machine's
    speed varies)."""
    dm = Parts()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (400, 40, 80)


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_categories=0), dict(num_categories=7), dict(train_per_category=0), dict(val_per_category=-1),
     dict(test_per_category=0), dict(noise=-0.1), dict(rotation="x"), dict(npoints=0), dict(batch_size=0)],
)  # fmt: skip
def test_bad_options(kwargs):
    with pytest.raises(UserError, match=next(iter(kwargs))):
        Parts(**kwargs)
