"""FID / Inception Score (tasks/metrics/fid.py): real numbers, offline.

No test downloads anything: the Inception weights are a seeded random
initialisation saved to a file once per module. Inception runs at 299x299 on
CPU, so the image sets are small (16 images) and their features are computed
once (module fixtures) and shared.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
import torch_fidelity.feature_extractor_inceptionv3 as tf_inception
from PIL import Image
from torchvision.utils import save_image

from attention.errors import UserError
from tasks.metrics import fid

N_IMAGES = 16
BATCH = 16


def smooth_images(n: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    """Random smooth float images in [-1, 1], (n, 3, 32, 32): 4x4 Gaussian noise upsampled bilinearly."""
    g = torch.Generator().manual_seed(seed)
    low = 0.5 * torch.randn(n, 3, 4, 4, generator=g)
    return (F.interpolate(low, size=(32, 32), mode="bilinear", align_corners=False) + shift).clamp(-1, 1)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    """A random-weights file in torch-fidelity's format (the same dict its own loader expects)."""
    path = tmp_path_factory.mktemp("inception") / "weights.pth"
    torch.save(fid._random_state_dict(seed=1), path)
    return str(path)


@pytest.fixture(scope="module")
def extractor(weights_file):
    return fid.load_inception(weights_file)


@pytest.fixture(scope="module")
def image_sets():
    """uint8 sets: a, b two independent samples of one distribution; a_bright = a's noise made brighter."""
    return {
        "a": fid.to_uint8(smooth_images(N_IMAGES, seed=1)),
        "b": fid.to_uint8(smooth_images(N_IMAGES, seed=2)),
        "a_bright": fid.to_uint8(smooth_images(N_IMAGES, seed=1, shift=0.6)),
    }


@pytest.fixture(scope="module")
def features(extractor, image_sets):
    return {k: fid.inception_features(extractor, v, batch_size=BATCH) for k, v in image_sets.items()}


@pytest.fixture(scope="module")
def stats_and_fid_ab(features):
    """2048-d FID statistics of a and b, and FID(a, b): each 2048-d FID costs seconds, so this one is shared."""
    stats = {k: fid.fid_statistics(features[k][0]) for k in ("a", "b")}
    return stats, fid.frechet_distance(stats["a"], stats["b"])


# ---------------------------------------------------------------------------
# Pixels


def test_to_uint8_quantises_like_save_image(tmp_path):
    x = torch.tensor([-1.0, 1.0, 0.0, -1.5, 1.5, -0.999, 0.999, 0.5 / 255 * 2 - 1]).view(1, 1, 1, 8).expand(1, 3, 1, 8)
    u = fid.to_uint8(x)
    assert u.dtype == torch.uint8
    assert u[0, 0, 0, :3].tolist() == [0, 255, 128]
    assert u[0, 0, 0, 3:5].tolist() == [0, 255]           # saturates outside [-1, 1]
    # bit-identical with torchvision's save_image on a random image (single image: no grid padding)
    img = torch.rand(1, 3, 17, 23) * 2.2 - 1.1
    save_image(img, tmp_path / "tv.png", normalize=True, value_range=(-1, 1))
    from_tv = torch.from_numpy(np.array(Image.open(tmp_path / "tv.png"))).permute(2, 0, 1)
    assert torch.equal(fid.to_uint8(img)[0], from_tv)


def test_save_pngs_round_trip(tmp_path):
    images = fid.to_uint8(torch.rand(3, 3, 9, 7) * 2 - 1)
    fid.save_pngs(images, tmp_path / "out" / "deeper", start=5)
    names = sorted(p.name for p in (tmp_path / "out" / "deeper").iterdir())
    assert names == ["000005.png", "000006.png", "000007.png"]
    for i, name in enumerate(names):
        back = torch.from_numpy(np.array(Image.open(tmp_path / "out" / "deeper" / name).convert("RGB")))
        assert torch.equal(back.permute(2, 0, 1), images[i])


# ---------------------------------------------------------------------------
# Metrics on hand-made numbers


def test_fid_statistics_are_float64_mean_and_covariance():
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    stats = fid.fid_statistics(x.float())
    assert stats["mu"].dtype == np.float64 and stats["sigma"].dtype == np.float64
    np.testing.assert_allclose(stats["mu"], x.float().double().numpy().mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats["sigma"], np.cov(x.float().double().numpy(), rowvar=False), rtol=1e-12)
    with pytest.raises(UserError, match="at least 2 images"):
        fid.fid_statistics(x[:1])


def test_frechet_distance_closed_form_for_commuting_covariances():
    # diagonal covariances commute: FID = |mu1 - mu2|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2
    a, b = np.array([1.0, 4.0, 9.0]), np.array([4.0, 1.0, 0.25])
    s1 = {"mu": np.array([0.0, 1.0, 2.0]), "sigma": np.diag(a)}
    s2 = {"mu": np.array([1.0, 1.0, 0.0]), "sigma": np.diag(b)}
    expected = 1 + 0 + 4 + (1 - 2) ** 2 + (2 - 1) ** 2 + (3 - 0.5) ** 2
    assert fid.frechet_distance(s1, s2) == pytest.approx(expected, rel=1e-12)
    assert fid.frechet_distance(s1, s1) == pytest.approx(0.0, abs=1e-12)


def test_frechet_distance_matches_scipy_sqrtm():
    rng = np.random.default_rng(0)
    a1, a2 = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    cov1, cov2 = a1 @ a1.T + 0.1 * np.eye(5), a2 @ a2.T + 0.1 * np.eye(5)   # non-commuting
    x1 = rng.multivariate_normal(np.zeros(5), cov1, size=400)
    x2 = rng.multivariate_normal(np.full(5, 0.7), cov2, size=300)
    s1, s2 = fid.fid_statistics(torch.from_numpy(x1)), fid.fid_statistics(torch.from_numpy(x2))
    m1, m2 = x1.mean(0), x2.mean(0)
    c1, c2 = np.cov(x1, rowvar=False), np.cov(x2, rowvar=False)
    covmean = scipy.linalg.sqrtm(c1 @ c2).real
    direct = float((m1 - m2) @ (m1 - m2) + np.trace(c1) + np.trace(c2) - 2 * np.trace(covmean))
    assert fid.frechet_distance(s1, s2) == pytest.approx(direct, rel=1e-9)
    assert fid.frechet_distance(s1, s2) == pytest.approx(fid.frechet_distance(s2, s1), rel=1e-9)


def fid_mp(x1: np.ndarray, x2: np.ndarray, digits: int = 40) -> float:
    """FID of two sets of features as torch-fidelity defines it (mean, ddof=1 covariance, the real parts of the
    square roots of the covariances' product's eigenvalues), all in ``digits``-digit arithmetic: a covariance of
    fewer images than features is rank-deficient there, where float64's has rounding-level eigenvalues instead."""
    import mpmath

    def stats(x):
        rows = mpmath.matrix(x.tolist())
        n, d = rows.rows, rows.cols
        mu = [mpmath.fsum(rows[i, j] for i in range(n)) / n for j in range(d)]
        centred = mpmath.matrix([[rows[i, j] - mu[j] for j in range(d)] for i in range(n)])
        return mu, centred.T * centred / (n - 1)

    with mpmath.workdps(digits):
        (m1, c1), (m2, c2) = stats(x1), stats(x2)
        eigenvalues = mpmath.eig(c1 * c2, left=False, right=False)
        trace_sqrt = mpmath.fsum(mpmath.re(mpmath.sqrt(mpmath.mpc(e))) for e in eigenvalues)
        value = (mpmath.fsum((a - b) ** 2 for a, b in zip(m1, m2)) + sum(c1[i, i] + c2[i, i] for i in range(c1.rows))
                 - 2 * trace_sqrt)
        return float(value)


def test_fid_statistics_of_fewer_images_than_features_carry_the_covariance_factor():
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    stats = fid.fid_statistics(x)
    assert stats["factor"].shape == (5, 10)
    np.testing.assert_allclose(stats["factor"].T @ stats["factor"], stats["sigma"], rtol=1e-12, atol=1e-15)
    assert "factor" in fid.fid_statistics(x[:, :6]) and "factor" not in fid.fid_statistics(x[:, :5])  # N <= D


@pytest.mark.parametrize("sizes", [(7, 40), (40, 7), (7, 5), (12, 12)], ids=lambda s: f"N={s[0]},{s[1]}")
def test_frechet_distance_of_fewer_images_than_features_is_the_extended_precision_value(sizes):
    """D = 12 features: one side with fewer images than features (7 against 40, either way round), both (7 and
    5; 12 and 12). Neither is torch-fidelity's own path, the tests above. Against the definition in 40 digits: the
    smaller forms are exact to float64 rounding, and torch-fidelity's (D, D) eigensolver agrees to its own noise."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(1)
    mix = rng.normal(size=(12, 12))
    x1 = rng.normal(size=(sizes[0], 12)) @ mix
    x2 = rng.normal(loc=0.3, size=(sizes[1], 12)) @ mix.T
    s1, s2 = fid.fid_statistics(torch.from_numpy(x1)), fid.fid_statistics(torch.from_numpy(x2))
    expected = fid_mp(x1, x2)
    assert fid.frechet_distance(s1, s2) == pytest.approx(expected, rel=1e-12)
    assert fid.frechet_distance(s2, s1) == pytest.approx(expected, rel=1e-12)
    without_factors = [{k: s[k] for k in ("mu", "sigma")} for s in (s1, s2)]
    assert fid.frechet_distance(*without_factors) == pytest.approx(expected, rel=1e-6)  # torch-fidelity's path
    torch_fidelity = fid_statistics_to_metric(*without_factors, verbose=False)["frechet_inception_distance"]
    assert fid.frechet_distance(s1, s2) == pytest.approx(torch_fidelity, rel=1e-6)


@pytest.mark.parametrize("sizes", [(30, 20), (20, 30), (13, 13)], ids=lambda s: f"N={s[0]},{s[1]}")
def test_frechet_distance_against_a_reference_root_is_the_extended_precision_value(sizes):
    """More images than features on both sides (D = 12), the reference carrying the square root of its covariance
    (``"root"``, as reference_statistics keeps it): one symmetric eigensolve of R.T sigma R a score. Against the
    definition in 40 digits, either side the reference; torch-fidelity's general eigensolver agrees to its noise."""
    rng = np.random.default_rng(3)
    mix = rng.normal(size=(12, 12))
    x1 = rng.normal(size=(sizes[0], 12)) @ mix
    x2 = rng.normal(loc=0.3, size=(sizes[1], 12)) @ mix.T
    s1, s2 = fid.fid_statistics(torch.from_numpy(x1)), fid.fid_statistics(torch.from_numpy(x2))
    assert "factor" not in s1 and "factor" not in s2
    root = fid.with_root(dict(s2))["root"]
    np.testing.assert_allclose(root @ root.T, s2["sigma"], rtol=1e-12, atol=1e-12 * np.abs(s2["sigma"]).max())
    expected = fid_mp(x1, x2)
    assert fid.frechet_distance(s1, {**s2, "root": root}) == pytest.approx(expected, rel=1e-12)
    assert fid.frechet_distance({**s2, "root": root}, s1) == pytest.approx(expected, rel=1e-12)
    assert fid.frechet_distance(s1, s2) == pytest.approx(expected, rel=1e-9)  # torch-fidelity's path


def test_frechet_distance_against_a_reference_root_with_dead_features_is_the_extended_precision_value():
    """Features that are 0 in every image (an Inception channel a data set never activates) make both covariances
    singular: the root's zero eigenvalues, rounding's on either side of 0, are taken as 0, and the score is still
    the definition's to 1e-12."""
    rng = np.random.default_rng(6)
    mix = rng.normal(size=(12, 12))
    x1, x2 = rng.normal(size=(30, 12)) @ mix, rng.normal(loc=0.2, size=(25, 12)) @ mix.T
    x1[:, [2, 7]] = 0.0
    x2[:, [2, 7]] = 0.0
    s1, s2 = fid.fid_statistics(torch.from_numpy(x1)), fid.with_root(fid.fid_statistics(torch.from_numpy(x2)))
    assert fid.frechet_distance(s1, s2) == pytest.approx(fid_mp(x1, x2), rel=1e-12)


@pytest.mark.parametrize("dead", [False, True], ids=["full-rank", "dead-features"])
def test_fid_written_for_the_gpu_is_the_extended_precision_value(dead):
    """On a GPU the validation's FID is computed there with torch (fid._fid_on_device: mean, np.cov's covariance,
    eigvalsh of R.T sigma R), run here on the CPU: the definition in 40 digits to 1e-12 (also with features dead in
    every image, which make both covariances singular), the CPU's frechet_distance to 1e-12, NaN for non-finite
    features."""
    rng = np.random.default_rng(8)
    mix = rng.normal(size=(12, 12))
    x1, x2 = rng.normal(size=(40, 12)) @ mix, rng.normal(loc=0.25, size=(30, 12)) @ mix.T
    if dead:
        x1[:, [1, 9]] = 0.0
        x2[:, [1, 9]] = 0.0
    reference = fid.with_root(fid.fid_statistics(torch.from_numpy(x2)))
    generated = torch.from_numpy(x1)
    ours = fid._fid_on_device(generated, reference, "cpu")
    assert ours == pytest.approx(fid_mp(x1, x2), rel=1e-12)
    assert ours == pytest.approx(fid.frechet_distance(fid.fid_statistics(generated), reference), rel=1e-12)
    bad = generated.clone()
    bad[5, 3] = float("nan")
    assert np.isnan(fid._fid_on_device(bad, reference, "cpu"))


def test_fid_against_a_reference_runs_on_the_cpu_but_for_a_cuda_device_with_more_images_than_features(monkeypatch):
    """fid_against_reference takes the device path only where it pays and is defined: a CUDA device, more images
    than features (else the low-rank factor's form, on the CPU), a reference with its root; the CPU, MPS (no
    float64) and no device keep frechet_distance."""
    rng = np.random.default_rng(9)
    reference = fid.with_root(fid.fid_statistics(torch.from_numpy(rng.normal(size=(30, 6)))))
    many, few = torch.from_numpy(rng.normal(size=(20, 6))), torch.from_numpy(rng.normal(size=(5, 6)))
    called = []
    monkeypatch.setattr(fid, "_fid_on_device", lambda *args: called.append(args[2]) or 0.0)
    for features, device, ref in ((many, None, reference), (many, "cpu", reference), (many, "mps", reference),
                                  (few, "cuda", reference), (many, "cuda", {"mu": reference["mu"],
                                                                             "sigma": reference["sigma"]})):
        expected = fid.frechet_distance(fid.fid_statistics(features), ref)
        assert fid.fid_against_reference(features, ref, device=device) == pytest.approx(expected, rel=1e-12)
    assert called == []
    assert fid.fid_against_reference(many, reference, device=torch.device("cuda", 0)) == 0.0
    assert called == [torch.device("cuda", 0)]
    with pytest.raises(UserError, match="at least 2 images"):
        fid.fid_against_reference(many[:1], reference, device="cuda")


@pytest.mark.cuda
def test_fid_on_the_gpu_is_the_cpus():
    """At the GAN validation's size (10,000 generated images, D = 2048, against a reference of 12,000 with its
    root): the GPU's float64 score against the CPU's."""
    g = torch.Generator().manual_seed(5)
    reference = fid.with_root(fid.fid_statistics(torch.rand(12000, 2048, generator=g, dtype=torch.float64)))
    generated = torch.rand(10000, 2048, generator=g, dtype=torch.float64).mul_(1.1)
    on_gpu = fid.fid_against_reference(generated, reference, device="cuda")
    on_cpu = fid.frechet_distance(fid.fid_statistics(generated), reference)
    assert on_gpu == pytest.approx(on_cpu, rel=1e-10)


def test_frechet_distance_against_a_reference_root_at_inception_sizes_is_torch_fidelitys():
    """D = 256 features, 400 generated against a reference of 600 (the validation FID's shape, smaller): the root's
    form against torch-fidelity's own function."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(4)
    reference = fid.with_root(fid.fid_statistics(torch.from_numpy(rng.gamma(1.0, size=(600, 256)))))
    generated = fid.fid_statistics(torch.from_numpy(rng.gamma(1.3, size=(400, 256))))
    theirs = fid_statistics_to_metric(*({k: s[k] for k in ("mu", "sigma")} for s in (generated, reference)),
                                      verbose=False)["frechet_inception_distance"]
    assert fid.frechet_distance(generated, reference) == pytest.approx(theirs, rel=1e-9)


def test_frechet_distance_of_a_few_samples_of_inception_features_is_torch_fidelitys():
    """The GAN task's case: a few hundred generated samples (here 50) of D = 2048 features against a full-rank
    reference, and a validation of 4 against 8. torch-fidelity's (D, D) eigenvalues carry ~1e-7 relative noise
    there (the square roots of ~2000 rounding-level eigenvalues)."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(2)
    reference = fid.fid_statistics(torch.from_numpy(rng.gamma(1.0, size=(2500, 2048))))
    for n, other in ((50, reference), (4, fid.fid_statistics(torch.from_numpy(rng.gamma(1.0, size=(8, 2048)))))):
        generated = fid.fid_statistics(torch.from_numpy(rng.gamma(1.2, size=(n, 2048))))
        theirs = fid_statistics_to_metric(*({k: s[k] for k in ("mu", "sigma")} for s in (generated, other)),
                                          verbose=False)["frechet_inception_distance"]
        assert fid.frechet_distance(generated, other) == pytest.approx(theirs, rel=1e-5), n


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_frechet_distance_of_non_finite_features_is_nan_not_a_traceback(bad):
    """A diverged generator's images give NaN features: scipy's sqrtm raised (LinAlgError) and the GAN run ended in
    a traceback at its validation, before its checkpoints; now FID is NaN, as IS and KID are, and the run fails
    through trainer.on_nan's check once it has written everything."""
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(40, 4)))
    good = fid.fid_statistics(x)
    x[3, 1] = bad
    for pair in ((fid.fid_statistics(x), good), (good, fid.fid_statistics(x))):
        assert np.isnan(fid.frechet_distance(*pair))
    assert np.isnan(fid.inception_score(torch.full((8, 1008), bad))[0])


def test_inception_score_hand_made_logits():
    mean, std = fid.inception_score(torch.zeros(10, 1008))
    assert mean == pytest.approx(1.0, abs=1e-12) and std == 0.0
    k = 7
    confident = 100.0 * F.one_hot(torch.arange(k), 1008).double()   # k samples, each sure of a distinct class
    assert fid.inception_score(confident)[0] == pytest.approx(k, rel=1e-9)
    # 2 splits after torch-fidelity's shuffle (seed 2020): with one-hot predictions a split's score is
    # exp(entropy of its class histogram)
    both = torch.cat([confident, confident])
    classes = np.concatenate([np.arange(k), np.arange(k)])[np.random.RandomState(2020).permutation(2 * k)]
    scores = []
    for half in (classes[:k], classes[k:]):
        q = np.bincount(half, minlength=k) / k
        scores.append(np.exp(-(q[q > 0] * np.log(q[q > 0])).sum()))
    mean, std = fid.inception_score(both, splits=2)
    assert mean == pytest.approx(np.mean(scores), rel=1e-9) and std == pytest.approx(np.std(scores), abs=1e-9)
    with pytest.raises(UserError, match="split"):
        fid.inception_score(confident, splits=8)


# ---------------------------------------------------------------------------
# Inception features and FID on images


def test_features_shapes_and_batching(extractor, image_sets, features):
    pool, logits = features["a"]
    assert pool.shape == (N_IMAGES, 2048) and logits.shape == (N_IMAGES, 1008)
    assert pool.dtype == logits.dtype == torch.float64
    assert torch.isfinite(pool).all() and pool.std(0).mean() > 1e-3   # informative, not collapsed to ~0
    # batch size does not change the features beyond float32 noise
    pool_4, logits_4 = fid.inception_features(extractor, image_sets["a"][:4], batch_size=3)
    torch.testing.assert_close(pool_4, pool[:4], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(logits_4, logits[:4], rtol=1e-4, atol=1e-6)


def test_fid_self_zero_shift_larger_than_independent_sample(features, stats_and_fid_ab):
    # FID is invariant under an isometry of a subspace holding all the features, so on the coordinates of the
    # pool features in an orthonormal basis of their span (48 dims) it equals the 2048-d value (checked on
    # FID(a, b)) at a fraction of the cost: each 2048-d FID is an eigendecomposition taking seconds on 2 cores.
    pools = {k: v[0] for k, v in features.items()}
    basis, _ = torch.linalg.qr(torch.cat(list(pools.values())).T)
    stats = {k: fid.fid_statistics(v @ basis) for k, v in pools.items()}
    independent = fid.frechet_distance(stats["a"], stats["b"])
    assert independent == pytest.approx(stats_and_fid_ab[1], rel=1e-4)
    same = fid.frechet_distance(stats["a"], stats["a"])
    shifted = fid.frechet_distance(stats["a_bright"], stats["b"])
    assert abs(same) < 1e-3 * independent
    assert independent > 0
    assert shifted > 3 * independent, (same, independent, shifted)


def test_matches_torch_fidelity_cli(tmp_path, weights_file, image_sets, features, stats_and_fid_ab):
    dirs = {}
    for k in ("a", "b"):
        dirs[k] = tmp_path / k
        fid.save_pngs(image_sets[k], dirs[k])
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TORCH_HOME": str(tmp_path / "torch")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        # the `fidelity` console script's own entry point (torch_fidelity.fidelity:main); run as a module, it needs no
        # script beside the interpreter (the GPU machine installs wheels with pip's --target, which writes none)
        sys.executable, "-m", "torch_fidelity.fidelity",
        "--input1", str(dirs["a"]), "--input2", str(dirs["b"]),
        "--fid", "--isc", "--isc-splits", "1",
        "--feature-extractor-weights-path", weights_file,
        "--batch-size", str(BATCH), "--cpu", "--json", "--silent", "--save-cpu-ram",
        "--no-cache", "--cache-root", str(tmp_path / "cache"),
        "--datasets-root", str(tmp_path / "datasets"), "--no-datasets-download",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Ignoring unrecognized" not in done.stderr, done.stderr
    theirs = json.loads(done.stdout)

    ours_fid = stats_and_fid_ab[1]   # frechet_distance(fid_statistics(features of a), ... of b)
    ours_is, _ = fid.inception_score(features["a"][1], splits=1)
    assert ours_fid == pytest.approx(theirs["frechet_inception_distance"], rel=1e-3)
    assert ours_is == pytest.approx(theirs["inception_score_mean"], rel=1e-3)
    # random weights give IS close to 1, so also compare the part above 1
    assert ours_is - 1 == pytest.approx(theirs["inception_score_mean"] - 1, rel=1e-3)
    assert theirs["frechet_inception_distance"] > 0
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*"))


# ---------------------------------------------------------------------------
# Reference statistics cache


def test_reference_statistics_cache(tmp_path, extractor, weights_file, image_sets, caplog):
    images = image_sets["a"][:4]
    calls = []

    def materialise():
        calls.append(1)
        return images

    def must_not_run():
        raise AssertionError("images materialised on a cache hit")

    caplog.set_level(logging.INFO, logger="tasks.metrics.fid")
    first = fid.reference_statistics(extractor, materialise, "toy/train", weights_file, tmp_path, batch_size=4)
    computation = fid.computation_id("cpu")   # the extractor's device and dtype (tests/test_fid_cache_key.py)
    expected_file = tmp_path / f"fid_ref_toy-train_{fid.weights_id(weights_file)}_{computation}.npz"
    assert calls == [1] and expected_file.is_file()
    assert "miss" in caplog.text

    caplog.clear()
    second = fid.reference_statistics(extractor, must_not_run, "toy/train", weights_file, tmp_path, batch_size=4)
    assert "hit" in caplog.text
    for k in ("mu", "sigma"):
        assert second[k].dtype == np.float64
        np.testing.assert_array_equal(second[k], first[k])
    # 4 images of 2048 features: the low-rank factor, rebuilt on a hit from the cached features to the same bits
    assert set(first) == set(second) == {"mu", "sigma", "factor"} and first["factor"].shape == (3, 2048)
    np.testing.assert_array_equal(second["factor"], first["factor"])

    # an unreadable cache file is recomputed and replaced, not fatal
    expected_file.write_bytes(b"truncated")
    caplog.clear()
    third = fid.reference_statistics(extractor, materialise, "toy/train", weights_file, tmp_path, batch_size=4)
    assert calls == [1, 1] and "unreadable" in caplog.text
    np.testing.assert_allclose(third["sigma"], first["sigma"])
    with np.load(expected_file, allow_pickle=False) as f:
        np.testing.assert_array_equal(f["mu"], third["mu"])
    # so is one whose features (the low-rank factor's source) are not the statistics' size
    np.savez(expected_file, mu=first["mu"], sigma=first["sigma"], features=np.zeros((4, 7), np.float32))
    caplog.clear()
    fourth = fid.reference_statistics(extractor, materialise, "toy/train", weights_file, tmp_path, batch_size=4)
    assert calls == [1, 1, 1] and "do not match" in caplog.text
    np.testing.assert_array_equal(fourth["factor"], first["factor"])

    # another weights id -> another file (the tensor itself may be passed instead of a callable)
    fid.reference_statistics(extractor, images, "toy/train", "random:1", tmp_path, batch_size=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [expected_file.name, f"fid_ref_toy-train_random-1_{computation}.npz"]
    )  # and no temp files left behind

    # no cache dir: computed, nothing written
    none_dir = fid.reference_statistics(extractor, images, "toy/train", weights_file, None, batch_size=4)
    np.testing.assert_allclose(none_dir["mu"], first["mu"])


def test_reference_statistics_of_more_images_than_features_keep_their_covariance_root(tmp_path, extractor,
                                                                                        monkeypatch):
    """A reference of more images than features (the GAN's training split) keeps the square root of its covariance,
    made once for every score against it, from the same float64 sigma on a hit as on a miss: the same bits. Its
    features here are 40 of 16 dimensions, given for the extractor's (the cache reads any consistent size)."""
    rows = np.random.default_rng(5).gamma(1.0, size=(40, 16)).astype(np.float32)
    monkeypatch.setattr(fid, "inception_features", lambda *args, **kwargs: (torch.from_numpy(rows).double(), None))

    def must_not_run():
        raise AssertionError("images materialised on a cache hit")

    images = torch.zeros(40, 3, 8, 8, dtype=torch.uint8)
    first = fid.reference_statistics(extractor, images, "toy/wide", "random:0", tmp_path, batch_size=4)
    second = fid.reference_statistics(extractor, must_not_run, "toy/wide", "random:0", tmp_path, batch_size=4)
    assert set(first) == set(second) == {"mu", "sigma", "root"}
    for key in first:
        np.testing.assert_array_equal(second[key], first[key])
    np.testing.assert_allclose(first["root"] @ first["root"].T, first["sigma"], rtol=1e-12, atol=1e-13)
    generated = fid.fid_statistics(torch.from_numpy(rows[::-1][:30].copy()) * 1.1)
    assert fid.frechet_distance(generated, first) == pytest.approx(
        fid.frechet_distance(generated, {k: first[k] for k in ("mu", "sigma")}), rel=1e-9)  # torch-fidelity's


def test_weights_id(weights_file, tmp_path):
    assert fid.weights_id(None) == "tf-2015-12-05"
    assert fid.weights_id("random") == "random-0"
    assert fid.weights_id("random:7") == "random-7"
    wid = fid.weights_id(weights_file)
    assert len(wid) == 12 and int(wid, 16) >= 0
    copy = tmp_path / "copy.pth"
    copy.write_bytes(Path(weights_file).read_bytes())
    assert fid.weights_id(str(copy)) == wid
    with pytest.raises(UserError, match="metrics.inception_weights"):
        fid.weights_id(str(tmp_path / "nope.pth"))


# ---------------------------------------------------------------------------
# Loading the network


def test_load_inception_file_and_random(weights_file, extractor, caplog):
    assert isinstance(extractor, tf_inception.FeatureExtractorInceptionV3)
    assert extractor.get_requested_features_list() == ["2048", "logits_unbiased"]
    assert not extractor.training and not any(p.requires_grad for p in extractor.parameters())
    assert fid.load_inception(weights_file) is extractor   # cached in-process
    with caplog.at_level(logging.WARNING, logger="tasks.metrics.fid"):
        random_1 = fid.load_inception("random:1")
    assert "not comparable" in caplog.text
    # the file holds the random:1 initialisation: both routes give the same network
    for (k, v), (k2, v2) in zip(extractor.state_dict().items(), random_1.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert fid.load_inception("random:1") is random_1
    with pytest.raises(UserError, match="random:SEED"):
        fid.load_inception("random:abc")


def test_load_inception_missing_file(tmp_path):
    missing = tmp_path / "no" / "weights.pth"
    with pytest.raises(UserError, match="metrics.inception_weights") as err:
        fid.load_inception(str(missing))
    assert str(missing) in str(err.value)


class _Exploit:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_load_inception_refuses_pickled_code(tmp_path):
    marker = tmp_path / "pwned"
    for i, payload in enumerate([{"x": os.system}, {"Conv2d_1a_3x3.conv.weight": _Exploit(marker)}]):
        path = tmp_path / f"evil{i}.pth"
        torch.save(payload, path)
        with pytest.raises(UserError, match="metrics.inception_weights") as err:
            fid.load_inception(str(path))
        assert "weights_only" in str(err.value) and "GLOBAL posix.system" in str(err.value)
    assert not marker.exists()


def test_load_inception_refuses_wrong_state_dict(tmp_path, weights_file):
    path = tmp_path / "foreign.pth"
    torch.save({"fc.weight": torch.zeros(1000, 2048), "other": torch.zeros(3)}, path)
    with pytest.raises(UserError, match="missing keys.*unexpected keys: other") as err:
        fid.load_inception(str(path))
    assert "fc.weight (1000, 2048)" in str(err.value)
    torch.save([torch.zeros(3)], path)
    with pytest.raises(UserError, match="not a dict of tensors"):
        fid.load_inception(str(path))
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="could not be loaded safely"):
        fid.load_inception(str(path))


def test_load_inception_offline_names_hub_cache_path(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", offline)
    monkeypatch.setattr(fid, "_EXTRACTORS", {})
    with pytest.raises(UserError) as err:
        fid.load_inception(None)
    message = str(err.value)
    expected = os.path.join(str(tmp_path / "torch"), "hub", "checkpoints", "weights-inception-2015-12-05-6726825d.pth")
    assert expected in message
    assert tf_inception.URL_INCEPTION_V3 in message
    assert "metrics.inception_weights" in message
