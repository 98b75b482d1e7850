"""KID (tasks/metrics/fid.py) and precision/recall (tasks/metrics/prc.py) for task=gan: real numbers, offline.

KID is held to a float64 transliteration of the unbiased MMD^2 estimator with torch-fidelity's subset draws, and
with PRC to torch-fidelity's own ``calculate_metrics`` on PNG folders of the same images with the same random
weights (files the tests write: nothing is downloaded). VGG16 at 224x224 on CPU is slow, so its sets hold 8 images.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import torch_fidelity
from PIL import Image

from attention.errors import UserError
from suite.validate import validate_config
from tasks.metrics import fid, prc
from test_config_checks import compose_run, refused
from test_fid import BATCH, N_IMAGES, extractor, features, image_sets, smooth_images, weights_file  # noqa: F401
from test_run import env, run  # noqa: F401 - env is a fixture

N_VGG = 8


@pytest.fixture(scope="module")
def vgg_weights_file(tmp_path_factory):
    """torchvision's VGG16 initialisation from seed 1, saved as the state dict torch-fidelity loads from a path."""
    path = tmp_path_factory.mktemp("vgg16") / "vgg16.pth"
    torch.save(prc.random_state_dict(seed=1), path)
    return str(path)


# ---------------------------------------------------------------------------
# KID on hand-made features


def kid_float64(x: np.ndarray, y: np.ndarray, subsets: int, size: int, degree=3, gamma=None, coef0=1.0):
    """Binkowski et al.'s KID written out in float64: mean and (population) std over subset pairs of the unbiased
    MMD^2 with k(a, b) = (gamma a.b + coef0)^degree; subsets drawn as torch-fidelity draws them (one RandomState
    seeded 2020, generated then reference indices, without replacement)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    gamma = 1.0 / x.shape[1] if gamma is None else gamma
    rng = np.random.RandomState(2020)
    values = []
    for _ in range(subsets):
        a = x[rng.choice(len(x), size, replace=False)]
        b = y[rng.choice(len(y), size, replace=False)]
        k_aa, k_bb, k_ab = 0.0, 0.0, 0.0
        for i in range(size):
            for j in range(size):
                if i != j:
                    k_aa += (gamma * a[i] @ a[j] + coef0) ** degree
                    k_bb += (gamma * b[i] @ b[j] + coef0) ** degree
                k_ab += (gamma * a[i] @ b[j] + coef0) ** degree
        values.append((k_aa + k_bb) / (size * (size - 1)) - 2 * k_ab / size**2)
    return float(np.mean(values)), float(np.std(values))


def test_kid_equals_float64_unbiased_mmd():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(23, 6, generator=g, dtype=torch.float64)
    y = torch.rand(19, 6, generator=g, dtype=torch.float64) + 0.1
    ours = fid.kernel_inception_distance(x, y, subsets=7, subset_size=9)
    expected = kid_float64(x.numpy(), y.numpy(), subsets=7, size=9)
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert ours[0] > 0 and ours[1] > 0   # a real shift, real spread over subsets
    # the kernel options reach the kernel; the reference may be a (float32) numpy array, as the cache holds it
    ours = fid.kernel_inception_distance(x, y.float().numpy(), subsets=3, subset_size=5, degree=2, gamma=0.3,
                                         coef0=0.5)
    expected = kid_float64(x.numpy(), y.float().numpy(), subsets=3, size=5, degree=2, gamma=0.3, coef0=0.5)
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # an unbiased estimator: two samples of one distribution give KID around 0, sometimes below
    same = fid.kernel_inception_distance(x[:11], x[11:], subsets=5, subset_size=11)
    assert abs(same[0]) < 0.2 * expected[0] + 1e-3


def test_kid_written_for_the_gpu_is_torch_fidelitys_function_and_the_float64_definition():
    """On a GPU, KID is computed there with torch (fid._kid_on_device), run here on the CPU: torch-fidelity's
    kid_features_to_metric given the same float64 features (the same subsets and estimator, to the order of the
    sums) and the definition written out, with the kernel's options."""
    from torch_fidelity.metric_kid import kid_features_to_metric

    g = torch.Generator().manual_seed(2)
    x = torch.rand(70, 64, generator=g, dtype=torch.float64)
    y = torch.rand(90, 64, generator=g, dtype=torch.float64) * 1.1
    theirs = kid_features_to_metric(x, y, kid_subsets=12, kid_subset_size=30, kid_kernel="poly",
                                    kid_kernel_poly_degree=3, kid_kernel_poly_gamma=None, kid_kernel_poly_coef0=1.0,
                                    rng_seed=2020, verbose=False)
    ours = fid._kid_on_device(x, y, 12, 30, 3, None, 1.0, "cpu")
    assert ours[0] == pytest.approx(theirs["kernel_inception_distance_mean"], rel=1e-9)
    assert ours[1] == pytest.approx(theirs["kernel_inception_distance_std"], rel=1e-7)
    assert fid.kernel_inception_distance(x, y, subsets=12, subset_size=30) == pytest.approx(ours, rel=1e-9)
    expected = kid_float64(x.numpy(), y.numpy(), subsets=3, size=5, degree=2, gamma=0.3, coef0=0.5)
    assert fid._kid_on_device(x, y, 3, 5, 2, 0.3, 0.5, "cpu") == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # A reference of float32 features, as the cache holds them: the rows drawn made float64, the same numbers as
    # the float64 copy the whole reference used to be turned into.
    y32 = y.float()
    assert fid._kid_on_device(x, y32, 12, 30, 3, None, 1.0, "cpu") == fid._kid_on_device(x, y32.double(), 12, 30, 3,
                                                                                          None, 1.0, "cpu")


def test_kid_on_a_device_moves_a_reference_too_large_for_it_pair_by_pair_to_the_same_numbers(monkeypatch):
    """A reference pool over ``KID_DEVICE_REFERENCE_BYTES`` stays on the host and each pair's rows are gathered there:
    the same subsets, so the same numbers, bit for bit, as the pool moved whole."""
    g = torch.Generator().manual_seed(4)
    x = torch.rand(40, 16, generator=g, dtype=torch.float64)
    y = torch.rand(50, 16, generator=g)  # float32, as cached
    whole = fid._kid_on_device(x, y, 6, 20, 3, None, 1.0, "cpu")
    monkeypatch.setattr(fid, "KID_DEVICE_REFERENCE_BYTES", y.numel() * 4 - 1)
    assert fid._kid_on_device(x, y, 6, 20, 3, None, 1.0, "cpu") == whole
    theirs = fid.kernel_inception_distance(x, y, subsets=6, subset_size=20)  # torch-fidelity's, float64 copies
    assert whole == pytest.approx(theirs, rel=1e-9)


@pytest.mark.cuda
def test_kid_on_the_gpu_is_the_cpus(monkeypatch):
    """At Inception's size (D = 2048) and torch-fidelity's subset size (1,000): the same subsets and float64
    kernels on the GPU as on the CPU."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(3000, 2048, generator=g, dtype=torch.float64)
    y = torch.rand(5000, 2048, generator=g).add_(0.05).numpy()  # float32, as the reference cache holds it
    on_gpu = fid.kernel_inception_distance(x, y, subsets=10, device="cuda")
    on_cpu = fid.kernel_inception_distance(x, y, subsets=10)
    assert on_gpu == pytest.approx(on_cpu, rel=1e-10)
    monkeypatch.setattr(fid, "KID_DEVICE_REFERENCE_BYTES", 0)  # each pair's rows gathered on the host and moved
    assert fid.kernel_inception_distance(x, y, subsets=10, device="cuda") == on_gpu


def test_kid_subset_size_null_caps_at_the_image_counts_and_a_number_must_fit():
    assert fid.kid_subset_size(None, 20000, 50000) == 1000   # torch-fidelity's default
    assert fid.kid_subset_size(None, 200, 400) == 200        # the demo's validation
    assert fid.kid_subset_size(50, 200, 400) == 50
    x = torch.rand(12, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert fid.kernel_inception_distance(x, x + 0.2, subsets=2) == \
        fid.kernel_inception_distance(x, x + 0.2, subsets=2, subset_size=12)
    for size in (13, 1):
        with pytest.raises(UserError, match=f"metrics.kid_subset_size={size} .*12 generated, 12 reference"):
            fid.kernel_inception_distance(x, x, subset_size=size)
    with pytest.raises(UserError, match="metrics.kid_subsets=0"):
        fid.kernel_inception_distance(x, x, subsets=0)


# ---------------------------------------------------------------------------
# Precision / recall on hand-made features


def prc_float64(generated: np.ndarray, real: np.ndarray, k: int) -> tuple[float, float]:
    """Kynkaenniemi et al.'s improved precision/recall in float64: a sample's radius is the distance to its k-th
    nearest other sample of its own set; precision = share of generated samples within the radius of some real
    sample, recall = share of real samples within the radius of some generated sample."""
    def radii(s):
        d = np.sqrt(((s[:, None] - s[None]) ** 2).sum(-1))
        return np.sort(d, axis=1)[:, k]   # column 0 is the sample itself

    def covered(points, centres):
        r = radii(centres)
        d = np.sqrt(((points[:, None] - centres[None]) ** 2).sum(-1))
        return float(np.mean([(d[i] <= r).any() for i in range(len(points))]))

    return covered(generated, real), covered(real, generated)


def test_precision_recall_equals_the_knn_definition():
    g = torch.Generator().manual_seed(3)
    real = torch.randn(40, 5, generator=g)
    generated = torch.cat([torch.randn(20, 5, generator=g), 3 + torch.randn(15, 5, generator=g)])  # part off-manifold
    for k in (1, 3, 5):
        precision, recall, f_score = prc.precision_recall(generated, real, neighborhood=k, batch_size=7)
        expected = prc_float64(generated.double().numpy(), real.double().numpy(), k)
        assert (precision, recall) == pytest.approx(expected, abs=1e-7), k   # torch-fidelity's float32 means
        assert f_score == pytest.approx(2 * precision * recall / (precision + recall), rel=1e-12)
        assert 0 < precision < 1 and 0 < recall <= 1
    with pytest.raises(UserError, match="metrics.prc_neighborhood=35"):
        prc.precision_recall(generated, real, neighborhood=35)


# ---------------------------------------------------------------------------
# Against torch-fidelity's calculate_metrics on image folders


def png_folder(images, folder):
    fid.save_pngs(images, folder)
    return str(folder)


def test_kid_matches_torch_fidelity_calculate_metrics(tmp_path, weights_file, image_sets, features):  # noqa: F811
    dirs = {k: png_folder(image_sets[k], tmp_path / k) for k in ("a", "a_bright")}
    options = dict(kid_subsets=20, kid_subset_size=10)
    theirs = torch_fidelity.calculate_metrics(
        input1=dirs["a_bright"], input2=dirs["a"], kid=True, feature_extractor_weights_path=weights_file,
        batch_size=BATCH, cuda=False, cache=False, verbose=False, **options)
    generated, reference = features["a_bright"][0], features["a"][0]
    ours = fid.kernel_inception_distance(generated, reference, subsets=20, subset_size=10)
    # our float64 kernels against torch-fidelity's float32 ones: equal to float32's rounding of the kernel sums
    assert ours[0] == pytest.approx(theirs["kernel_inception_distance_mean"], rel=1e-4)
    assert ours[1] == pytest.approx(theirs["kernel_inception_distance_std"], rel=1e-3)
    assert ours[0] > 5 * ours[1] > 0   # a brighter set is clearly far
    # with its float32 arithmetic on our in-memory features, torch-fidelity's KID is its number from the PNGs:
    # the same pixels, features and subset draws
    from torch_fidelity.metric_kid import kid_features_to_metric
    same = kid_features_to_metric(generated.float(), reference.float(), verbose=False, **options)
    assert same["kernel_inception_distance_mean"] == pytest.approx(theirs["kernel_inception_distance_mean"],
                                                                   rel=1e-6)
    assert same["kernel_inception_distance_std"] == pytest.approx(theirs["kernel_inception_distance_std"], rel=1e-6)


def test_precision_recall_matches_torch_fidelity_calculate_metrics(tmp_path, vgg_weights_file,
                                                                   image_sets):  # noqa: F811
    generated, real = image_sets["a"][:N_VGG], image_sets["b"][:N_VGG]
    dirs = {"generated": png_folder(generated, tmp_path / "g"), "real": png_folder(real, tmp_path / "r")}
    extractor = prc.load_vgg16(vgg_weights_file)
    assert prc.load_vgg16(vgg_weights_file) is extractor
    ours = prc.precision_recall(prc.vgg16_features(extractor, generated, batch_size=N_VGG),
                                prc.vgg16_features(extractor, real, batch_size=N_VGG), neighborhood=2)
    theirs = torch_fidelity.calculate_metrics(
        input1=dirs["generated"], input2=dirs["real"], prc=True, prc_neighborhood=2,
        feature_extractor_weights_path=vgg_weights_file, batch_size=N_VGG, cuda=False, cache=False, verbose=False)
    assert ours == pytest.approx((theirs["precision"], theirs["recall"], theirs["f_score"]), abs=1e-12)
    assert 0 < ours[0] < 1 and 0 < ours[1] < 1   # these sets and weights give informative values (5/8, 7/8)


# ---------------------------------------------------------------------------
# Reference caches


def test_reference_cache_keeps_the_pool_features(tmp_path, extractor, weights_file, image_sets, caplog):  # noqa: F811
    images = image_sets["a"][:2]
    caplog.set_level(logging.INFO, logger="tasks.metrics.fid")
    first = fid.reference_statistics(extractor, images, "toy", weights_file, tmp_path, batch_size=2,
                                     keep_features=True)
    pool, _ = fid.inception_features(extractor, images, batch_size=2)
    assert first["features"].dtype == np.float32 and first["features"].shape == (2, 2048)
    np.testing.assert_array_equal(first["features"], pool.float().numpy())
    assert np.array_equal(first["features"].astype(np.float64), pool.numpy())   # float32 holds them exactly

    def must_not_run():
        raise AssertionError("images materialised on a cache hit")

    caplog.clear()
    second = fid.reference_statistics(extractor, must_not_run, "toy", weights_file, tmp_path, keep_features=True)
    assert "hit" in caplog.text
    for k in ("mu", "sigma", "features"):
        np.testing.assert_array_equal(second[k], first[k])
    assert "features" not in fid.reference_statistics(extractor, must_not_run, "toy", weights_file, tmp_path)

    # a file written before features were kept: good for FID alone, recomputed (and rewritten) for KID
    (path,) = tmp_path.glob("fid_ref_toy_*.npz")
    np.savez(path, mu=first["mu"], sigma=first["sigma"])
    assert "features" not in fid.reference_statistics(extractor, must_not_run, "toy", weights_file, tmp_path)
    caplog.clear()
    third = fid.reference_statistics(extractor, images, "toy", weights_file, tmp_path, batch_size=2,
                                     keep_features=True)
    assert "without the pool features" in caplog.text
    np.testing.assert_array_equal(third["features"], first["features"])
    with np.load(path, allow_pickle=False) as f:
        np.testing.assert_array_equal(f["features"], first["features"])


def test_prc_reference_cache_round_trip(tmp_path, caplog):
    extractor = prc.load_vgg16("random:2")
    images = fid.to_uint8(smooth_images(2, seed=5))
    caplog.set_level(logging.INFO, logger="tasks.metrics.prc")
    first = prc.reference_features(extractor, images, "toy/train", "random:2", tmp_path, batch_size=2)
    assert first.shape == (2, 4096) and first.dtype == torch.float32 and first.std(0).mean() > 0
    assert [p.name for p in tmp_path.iterdir()] == [f"prc_ref_toy-train_random-2_{fid.computation_id('cpu')}.npz"]

    def must_not_run():
        raise AssertionError("images materialised on a cache hit")

    again = prc.reference_features(extractor, must_not_run, "toy/train", "random:2", tmp_path)
    assert "cache hit" in caplog.text and torch.equal(again, first)


def test_vgg16_weights_are_vetted(tmp_path):
    with pytest.raises(UserError, match="metrics.vgg16_weights"):
        prc.load_vgg16(str(tmp_path / "missing.pth"))
    path = tmp_path / "foreign.pth"
    torch.save({"classifier.0.weight": torch.zeros(3)}, path)
    with pytest.raises(UserError, match=r"missing keys: features\.0\.weight.*wrong shapes: classifier\.0\.weight"):
        prc.load_vgg16(str(path))
    with pytest.raises(UserError, match="random:SEED"):
        prc.load_vgg16("random:x")


# ---------------------------------------------------------------------------
# Config checks and a run


def test_kid_subset_size_and_prc_neighbourhood_are_checked_at_composition():
    err = refused(["task=gan", "metrics.num_samples=200", "metrics.kid_subset_size=500"])
    assert "metrics.kid_subset_size=500" in err and "metrics.num_samples=200" in err and "null" in err
    err = refused(["task=gan", "eval.num_samples=64", "metrics.prc=true", "metrics.prc_neighborhood=64"])
    assert "metrics.prc_neighborhood=64" in err and "eval.num_samples=64" in err
    cfg = compose_run(["experiment=gan_demo"])   # the demo's 200 / 400 samples fit the defaults
    assert cfg.metrics.kid and cfg.metrics.kid_subset_size is None and not cfg.metrics.prc
    overrides = ["task=gan", "metrics.kid=false", "metrics.kid_subset_size=500", "metrics.num_samples=200"]
    validate_config(compose_run(overrides), overrides)   # KID off: its subset size is not checked


def test_gan_run_records_kid_precision_recall_and_their_protocol(env, tmp_path):  # noqa: F811
    out, samples = tmp_path / "run", tmp_path / "samples"
    run(["task=gan", "data=digits", "attn=external", "model.g_channels=16", "model.d_channels=16", "model.z_dim=16",
         "data.batch_size=4", "task.d_steps=2", "task.grid_per_class=2", "trainer.max_steps=1",
         "metrics.every_n_steps=1", "metrics.num_samples=8", "eval.num_samples=8", "metrics.reference_samples=8",
         "metrics.batch_size=4", "metrics.inception_weights=random", "metrics.prc=true",
         "metrics.vgg16_weights=random", "metrics.kid_subsets=5", f"metrics.cache_dir={tmp_path / 'cache'}",
         f"eval.save_samples={samples}", "logger=none", "trainer.enable_progress_bar=false",
         # the CPU, where the features recomputed below come from (on a GPU cuDNN's TF32 convolutions move them ~1e-4)
         "trainer.accelerator=cpu", f"hydra.run.dir={out}"], env)
    metrics = json.loads((out / "metrics.json").read_text())
    p = metrics["protocol"]
    assert p["kid_subsets"] == 5 and p["kid_subset_size"] == "min(1000, generated, reference images)"
    assert p["kid_kernel"] == "poly degree 3 gamma 1/2048 coef0 1"
    assert p["prc"] == "k=3, vgg16 fc2_relu (random weights, not comparable)"
    assert p["fid_samples"] == 8 and p["fid_reference"] == "train split (8 drawn at random, seed 0)"
    for key in ("val/kid", "val/precision", "test/kid_std", "test/recall"):
        assert key in metrics and np.isfinite(metrics[key]), key
    # the test numbers are the metrics of the saved samples against the cached reference features
    images = torch.stack([torch.from_numpy(np.array(Image.open(f).convert("RGB"))).permute(2, 0, 1)
                          for f in sorted(samples.glob("*.png"))])   # (8, 3, 32, 32) uint8
    assert len(images) == 8
    (fid_file,) = (tmp_path / "cache").glob("fid_ref_*_random-0_cpu-float32-*.npz")
    (prc_file,) = (tmp_path / "cache").glob("prc_ref_*_random-0_cpu-float32-*.npz")
    pool, _ = fid.inception_features(fid.load_inception("random"), images, batch_size=4)
    with np.load(fid_file) as f:
        kid = fid.kernel_inception_distance(pool, f["features"], subsets=5)
    assert (metrics["test/kid"], metrics["test/kid_std"]) == pytest.approx(kid, rel=1e-6, abs=1e-12)
    vgg = prc.vgg16_features(prc.load_vgg16("random"), images, batch_size=4)
    with np.load(prc_file) as f:
        precision, recall, _ = prc.precision_recall(vgg, torch.from_numpy(f["features"]))
    assert (metrics["test/precision"], metrics["test/recall"]) == pytest.approx((precision, recall), abs=1e-12)


def test_protocol_names_the_kid_and_prc_options():
    from suite.run_record import protocol

    base = {"task": {"name": "gan"}, "data": {"_target_": "datamodules.CIFAR10"}, "eval": {"num_samples": None}}
    off = protocol({**base, "metrics": {"num_samples": 10000, "kid": False, "prc": False}})
    assert "kid_subsets" not in off and off["prc"] == "off"
    on = protocol({**base, "metrics": {"num_samples": 10000, "kid": True, "kid_subsets": 100, "kid_subset_size": 1000,
                                       "kid_degree": 3, "kid_gamma": 0.5, "kid_coef0": 1, "prc": True,
                                       "prc_neighborhood": 5, "vgg16_weights": "/w/vgg16-397923af.pth"}})
    assert on["kid_subsets"] == 100 and on["kid_subset_size"] == 1000
    assert on["kid_kernel"] == "poly degree 3 gamma 0.5 coef0 1"
    assert on["prc"] == "k=5, vgg16 fc2_relu (vgg16-397923af.pth)"


def test_protocol_records_the_sample_counts_the_data_module_generates():
    """data.val_samples / data.test_samples set themselves (configs/task/gan.yaml interpolates them from
    metrics.num_samples / eval.num_samples): the record named the metrics' counts ("as many as training images"
    for a test of 7), not the counts scored."""
    from suite.run_record import protocol

    base = {"task": {"name": "gan"}, "metrics": {"num_samples": 8, "kid": False, "reference_samples": None},
            "eval": {"num_samples": None}}
    p = protocol({**base, "data": {"_target_": "datamodules.Digits", "val_samples": 5, "test_samples": 7}})
    assert p["selected_on"] == "val FID of 5 samples" and p["fid_samples"] == 7 and p["fid_reference"] == "train split"
    p = protocol({**base, "data": {"_target_": "datamodules.Digits", "val_samples": None, "test_samples": None}})
    assert p["selected_on"] == "val FID of as many samples as training images"
    assert p["fid_samples"] == "as many as training images"
