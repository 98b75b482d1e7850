"""FID, Inception Score and KID for the GAN task, with torch-fidelity's TF-compatible Inception.

Everything numerical is torch-fidelity's own code: the feature extractor
(``FeatureExtractorInceptionV3``, registered as ``inception-v3-compat``: the
2015-12-05 TensorFlow graph ported bit-for-bit, including its resizing),
``fid_features_to_statistics`` / ``fid_statistics_to_metric``,
``isc_features_to_metric`` and ``kid_features_to_metric`` (KID on the same
pool features as FID: no second pass), but for FID's trace term, computed in an
equal symmetric form where one side has fewer images than features or is a
cached reference (:func:`frechet_distance`), and for KID and the validation's
FID on a GPU, computed there with torch (:func:`kernel_inception_distance`,
:func:`fid_against_reference`). This module only adds
what a training loop needs around them:

* :func:`to_uint8` quantises generator output in [-1, 1] exactly as
  ``torchvision.utils.save_image`` does, so scoring the in-memory tensor and
  scoring PNGs written by :func:`save_pngs` (e.g. with torch-fidelity's
  ``fidelity`` command) see the same pixels;
* :func:`load_inception` builds the extractor once per process from the
  official weights (downloaded into torch hub's cache), from a local file that
  is vetted with ``torch.load(weights_only=True)`` first, or from a seeded
  random initialisation for offline smoke runs (``"random"`` / ``"random:SEED"``);
* :func:`reference_statistics` caches the real set's FID statistics and pool
  features (KID draws its subsets from them) on disk, keyed by a dataset key,
  :func:`weights_id` and :func:`computation_id` (device type, the extractor's
  dtype, on CUDA the TF32 switches, torch-fidelity's version).

Scores from random weights, or from fewer than the customary 50,000 samples,
are not comparable with published numbers.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import torch_fidelity
import torch_fidelity.feature_extractor_inceptionv3 as _tf_inception
from PIL import Image
from torch import Tensor
from torch_fidelity.defaults import DEFAULTS
from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_features_to_statistics, fid_statistics_to_metric
from torch_fidelity.metric_isc import KEY_METRIC_ISC_MEAN, KEY_METRIC_ISC_STD, isc_features_to_metric
from torch_fidelity.metric_kid import KEY_METRIC_KID_MEAN, KEY_METRIC_KID_STD, kid_features_to_metric
from tqdm import tqdm

from attention.errors import UserError

from .extractor_weights import ExtractorWeights

log = logging.getLogger(__name__)

EXTRACTOR_NAME = "inception-v3-compat"
FEATURES = ["2048", "logits_unbiased"]   # FID's pool features, IS's logits (torch-fidelity's defaults)
OFFICIAL_WEIGHTS_ID = "tf-2015-12-05"
ISC_RNG_SEED = 2020                      # torch-fidelity's default ``rng_seed`` (IS's shuffle, KID's subsets)
KID_SUBSET_SIZE = DEFAULTS["kid_subset_size"]   # 1000, used when metrics.kid_subset_size is null

_EXTRACTORS: dict[object, FeatureExtractorInceptionV3] = {}   # load_inception's per-process cache
_BUILD_LOCK = threading.Lock()                                 # guards the temporary patch in _construct


# ---------------------------------------------------------------------------
# Pixels


def to_uint8(images: Tensor) -> Tensor:
    """Float images in [-1, 1], (B, C, H, W) -> uint8, quantised exactly as ``save_image`` does.

    ``torchvision.utils.save_image(x, normalize=True, value_range=(-1, 1))``
    maps to [0, 1] and then computes ``(x * 255 + 0.5).clamp(0, 255)`` before
    truncating to uint8: round-half-up, so -1 -> 0, 0 -> 128, 1 -> 255 and
    values outside [-1, 1] saturate. Half-precision input is widened to
    float32 first. The result stays on the input's device.
    """
    if not images.is_floating_point():
        raise TypeError(f"to_uint8 expects float images in [-1, 1], got dtype {images.dtype}")
    x = images.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    x01 = (x + 1) / 2
    return (x01 * 255 + 0.5).clamp(0, 255).to(torch.uint8)


def save_pngs(images_uint8: Tensor, folder: str | Path, start: int = 0) -> None:
    """Write one PNG per image as ``folder/{i:06d}.png`` for i = start, start + 1, ...

    ``images_uint8`` is (B, 3, H, W) (or (B, 1, H, W), written as grayscale)
    uint8; PNG is lossless, so the files read back bit-identical. Creates
    ``folder`` (and its parents) if needed; existing files of the same name are
    overwritten.
    """
    _check_uint8_images(images_uint8, "save_pngs", channels=(1, 3))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hwc = images_uint8.detach().cpu().permute(0, 2, 3, 1).contiguous().numpy()
    for i, img in enumerate(hwc):
        Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img).save(folder / f"{start + i:06d}.png")


def _check_uint8_images(images: Tensor, where: str, channels: tuple[int, ...]) -> None:
    if not torch.is_tensor(images) or images.dtype != torch.uint8:
        raise TypeError(f"{where} expects a uint8 tensor (use to_uint8), got {getattr(images, 'dtype', type(images))}")
    if images.dim() != 4 or images.shape[1] not in channels:
        raise ValueError(f"{where} expects images (B, C, H, W) with C in {channels}, got {tuple(images.shape)}")


# ---------------------------------------------------------------------------
# The Inception network


INCEPTION = ExtractorWeights("metrics.inception_weights", URL_INCEPTION_V3, OFFICIAL_WEIGHTS_ID,
                             "torch-fidelity's Inception weights", "FID/IS/KID")
hub_weights_path, weights_id = INCEPTION.hub_path, INCEPTION.id


class _Skeleton(FeatureExtractorInceptionV3):
    """torch-fidelity's architecture with loading disabled: only used (on the meta device) for names and shapes."""

    def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ARG002 - nothing to load
        return None


def _patched_loader(state_dict: Mapping[str, Tensor]) -> Callable:
    def load_state_dict_from_url(*args, **kwargs):  # noqa: ARG001 - same signature as torch.hub's
        return state_dict

    return load_state_dict_from_url


def _construct(
    state_dict: Mapping[str, Tensor] | None, cls: type = FeatureExtractorInceptionV3
) -> FeatureExtractorInceptionV3:
    """torch-fidelity's extractor with ``state_dict`` (None: download from its URL, its default).

    Its constructor knows two weight sources: ``torch.load(path,
    weights_only=False)``, which would unpickle the file a second time without
    the safety of our own ``weights_only=True`` load, and
    ``load_state_dict_from_url``. To give it the dict we already loaded and
    vetted, swap the latter (a module global of torch-fidelity) for a function
    returning that dict for the duration of the call, under a lock so that
    concurrent constructions cannot observe each other's patch.
    """
    # The layers' default initialisation (then overwritten by the weights) must not move the caller's global
    # generator: the extractor is built lazily, at the first evaluation, which a resumed run reaches elsewhere.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        if state_dict is None:
            return cls(EXTRACTOR_NAME, list(FEATURES), verbose=True)
        saved = _tf_inception.load_state_dict_from_url
        _tf_inception.load_state_dict_from_url = _patched_loader(state_dict)
        try:
            return cls(EXTRACTOR_NAME, list(FEATURES))
        finally:
            _tf_inception.load_state_dict_from_url = saved


_TEMPLATE: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}


def _template() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of the extractor's state dict (built once on the meta device: no memory, no init)."""
    if not _TEMPLATE:
        with torch.device("meta"):
            skeleton = _construct({}, _Skeleton)
        _TEMPLATE.update({k: (tuple(v.shape), v.dtype) for k, v in skeleton.state_dict().items()})
    return _TEMPLATE


def _random_state_dict(seed: int) -> dict[str, Tensor]:
    """A seeded random initialisation whose activations keep a sensible scale through the whole network.

    PyTorch's default init shrinks the signal ~1e-8-fold over Inception's depth,
    which makes every score ~0; He-normal convolutions with identity batch norm
    keep features O(0.1), so smoke runs and tests see informative numbers.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in _template().items():
        if name.endswith("num_batches_tracked"):
            t = torch.zeros(shape, dtype=dtype)
        elif len(shape) == 4:   # convolution weight
            t = torch.nn.init.kaiming_normal_(torch.empty(shape), nonlinearity="relu", generator=g)
        elif name == "fc.weight":
            t = torch.randn(shape, generator=g) / shape[1] ** 0.5
        elif name.endswith((".bn.weight", "running_var")):
            t = torch.ones(shape)
        else:                   # batch-norm biases and running means, fc bias
            t = torch.zeros(shape)
        out[name] = t.to(dtype)
    return out


def load_inception(weights: str | None = None) -> torch.nn.Module:
    """torch-fidelity's ``inception-v3-compat`` extractor of ("2048", "logits_unbiased"), eval mode, no grad, on CPU.

    ``weights``: None downloads the official weights once into torch hub's cache (torch-fidelity's default); a
    path loads that file, vetted; ``"random"`` / ``"random:SEED"`` uses :func:`_random_state_dict`, for offline
    smoke runs and tests only (:mod:`.extractor_weights`). Extractors are cached per weights choice for the life
    of the process; callers may move the returned module to another device (the cached instance moves with it).
    """
    return INCEPTION.load(weights, _EXTRACTORS, _construct, _random_state_dict,
                          lambda: {k: shape for k, (shape, _) in _template().items()},
                          hint=" Weights of other Inception ports (e.g. torchvision's) must be converted with "
                               "torch-fidelity's util_convert_inception_weights first.")


# ---------------------------------------------------------------------------
# Features and metrics


@torch.no_grad()
def inception_features(
    extractor: torch.nn.Module, images_uint8: Tensor, batch_size: int = 50, progress: bool = False,
    keep_on_device: bool = False,
) -> tuple[Tensor, Tensor]:
    """(pool features (N, 2048), logits_unbiased (N, 1008)) of uint8 (N, 3, H, W) images, float64 on CPU (with
    ``keep_on_device``, on the extractor's device: a copy to the host waits for the network, so a GPU
    validation that copied each batch's features idled while the host queued the next batch's work).

    Runs in batches of ``batch_size`` on the extractor's device (torch-fidelity
    resizes to 299x299 inside the network). Single-channel images are
    replicated to RGB, as PIL's ``convert("RGB")`` does when torch-fidelity
    reads grayscale files.
    """
    _check_uint8_images(images_uint8, "inception_features", channels=(1, 3))
    to = extractor_device(extractor) if keep_on_device else torch.device("cpu")
    pools, logits = [], []
    for batch in rgb_batches(extractor, images_uint8, batch_size, progress, "Inception features"):
        out = extractor.convert_features_tuple_to_dict(extractor(batch))
        pools.append(out["2048"].to(to, torch.float64))
        logits.append(out["logits_unbiased"].to(to, torch.float64))
    if not pools:
        return (torch.empty(0, 2048, dtype=torch.float64, device=to),
                torch.empty(0, 1008, dtype=torch.float64, device=to))
    return torch.cat(pools), torch.cat(logits)


def rgb_batches(extractor: torch.nn.Module, images_uint8: Tensor, batch_size: int, progress: bool, desc: str):
    """Batches of ``batch_size`` uint8 images on the extractor's device, single-channel ones replicated to RGB (as
    PIL's ``convert("RGB")`` does when torch-fidelity reads grayscale files), with a progress bar."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(extractor.parameters()).device
    n = images_uint8.shape[0]
    with tqdm(total=n, disable=not progress, unit="img", desc=desc, leave=False) as bar:
        for start in range(0, n, batch_size):
            batch = images_uint8[start : start + batch_size].to(device, non_blocking=True)  # (b, 1|3, H, W)
            yield batch.expand(-1, 3, -1, -1) if batch.shape[1] == 1 else batch
            bar.update(batch.shape[0])


def fid_statistics(features: Tensor) -> dict[str, np.ndarray]:
    """torch-fidelity's FID statistics ``{"mu": (D,), "sigma": (D, D)}`` (float64) of (N, D) features and, for
    fewer images than features (N <= D), ``"factor"`` (:func:`covariance_factor`), which :func:`frechet_distance`
    uses."""
    if features.dim() != 2 or features.shape[0] < 2:
        raise UserError(
            f"FID statistics need at least 2 images (features of shape {tuple(features.shape)} were given); raise "
            f"the number of images used for FID (hundreds at least, 50,000 for comparable numbers)."
        )
    features = features.detach().to("cpu", torch.float64)
    stats = fid_features_to_statistics(features)
    out = {"mu": np.asarray(stats["mu"], dtype=np.float64), "sigma": np.asarray(stats["sigma"], dtype=np.float64)}
    factor = covariance_factor(features.numpy())
    if factor is not None:
        out["factor"] = factor
    return out


def covariance_factor(features: np.ndarray) -> np.ndarray | None:
    """For (N, D) features with N <= D: F of shape (N - 1, D) with F.T F their covariance (ddof=1), of full row
    rank for features in general position; None for N > D (or N < 2). F = (H X)[1:] / sqrt(N - 1), H the Householder
    reflection taking the unit vector of ones to e_1: H's other rows span the vectors orthogonal to the ones, so
    they centre X with no structural zero left, where the (N, D) centred X has one (its rows sum to 0), whose
    rounding-level eigenvalue :func:`frechet_distance` would take the square root of."""
    x = np.asarray(features, dtype=np.float64)
    n, d = x.shape
    if n > d or n < 2:
        return None
    u = np.full(n, 1 / math.sqrt(n))
    u[0] -= 1.0                                                     # H = I - 2 u u.T / (u.T u)
    reflected = x - np.outer(u, (2 / (u @ u)) * (u @ x))             # (N, D) = H X
    return reflected[1:] / math.sqrt(n - 1)                          # (N - 1, D)


def covariance_root(sigma: np.ndarray) -> np.ndarray:
    """R (D, D) with R R.T = sigma, for a symmetric positive semi-definite sigma: V diag(sqrt(lambda)) from its
    eigendecomposition (eigenvalues below zero, rounding's, taken as 0). :func:`reference_statistics` keeps one for a
    reference of more images than features, where :func:`frechet_distance` then needs one symmetric eigensolve of
    R.T sigma R a score instead of torch-fidelity's general one of sigma_1 sigma_2."""
    sigma = np.asarray(sigma, dtype=np.float64)
    eigenvalues, vectors = np.linalg.eigh((sigma + sigma.T) / 2)
    return vectors * np.sqrt(np.clip(eigenvalues, 0, None))                   # (D, D): column i times sqrt(lambda_i)


def frechet_distance(stats_1: Mapping[str, np.ndarray], stats_2: Mapping[str, np.ndarray]) -> float:
    """FID between two sets of statistics (torch-fidelity's ``fid_statistics_to_metric``), in float64.

    NaN when either holds a NaN or an infinity (images of a diverged generator), as the Inception Score and KID of
    such features are: scipy's ``sqrtm`` would raise instead, ending the run in a traceback at its validation,
    where a NaN score lets it write its checkpoints and fail through ``trainer.on_nan``'s check (``suite/guard.py``).

    The trace term tr sqrt(sigma_1 sigma_2) is torch-fidelity's (the square roots of ``eigvals(sigma_1 @
    sigma_2)``) unless a side carries :func:`fid_statistics`'s ``"factor"`` F (fewer images than features, as a
    validation of a few hundred samples has): sigma = F.T F, so the nonzero eigenvalues of sigma_1 sigma_2 =
    F.T (F sigma_2) are those of the (N - 1, N - 1) symmetric F sigma_2 F.T (with both factors: the squared singular
    values of F_1 F_2.T). The same number, computed here because torch-fidelity's general eigensolver on (D, D) took
    6 s of a 2-core CPU for every score, and in that case sums the square roots of D - N + 1 rounding-level
    eigenvalues (~1e-7 relative noise), which the smaller form does not have. Otherwise, where a side carries a
    square root R of its covariance (``"root"``, :func:`covariance_root`: a cached reference of more images than
    features), the eigenvalues of sigma_1 sigma_2 = R R.T sigma_2 are those of the symmetric R.T sigma_2 R: two
    products and a symmetric eigensolve a score, where the reference's own eigensolve is made once: at D = 2048,
    1.7 s a score against torch-fidelity's 5.2 s on one CPU thread, 0.9 s against 3.5 s on two (the root: 2.5 s and
    1.2 s, once), agreeing to 1e-14.
    """
    keys = ("mu", "sigma", "factor", "root")
    s1 = {k: np.asarray(v, dtype=np.float64) for k, v in stats_1.items() if k in keys}
    s2 = {k: np.asarray(v, dtype=np.float64) for k, v in stats_2.items() if k in keys}
    if s1["mu"].shape != s2["mu"].shape or s1["sigma"].shape != s2["sigma"].shape:
        raise ValueError(
            f"FID statistics of different feature sizes: mu {s1['mu'].shape} vs {s2['mu'].shape}, "
            f"sigma {s1['sigma'].shape} vs {s2['sigma'].shape}"
        )
    if not all(np.isfinite(v).all() for s in (s1, s2) for v in s.values()):
        return math.nan
    if "factor" in s1 and "factor" in s2:
        tr_covmean = float(np.linalg.svd(s1["factor"] @ s2["factor"].T, compute_uv=False).sum())  # (N1-1, N2-1)
    elif "factor" in s1 or "factor" in s2:
        factor, other = (s1["factor"], s2["sigma"]) if "factor" in s1 else (s2["factor"], s1["sigma"])
        tr_covmean = _trace_sqrt(factor @ other @ factor.T)                           # (N - 1, N - 1)
    elif "root" in s1 or "root" in s2:
        root, other = (s1["root"], s2["sigma"]) if "root" in s1 else (s2["root"], s1["sigma"])
        tr_covmean = _trace_sqrt(root.T @ other @ root)                               # (D, D)
    else:
        return float(fid_statistics_to_metric(s1, s2, verbose=False)[KEY_METRIC_FID])
    diff = s1["mu"] - s2["mu"]
    return float(diff @ diff + np.trace(s1["sigma"]) + np.trace(s2["sigma"]) - 2 * tr_covmean)


def _trace_sqrt(product: np.ndarray) -> float:
    """tr sqrt of a symmetric positive semi-definite matrix (a product such as F sigma F.T, symmetric but for
    rounding): the sum of the square roots of its eigenvalues, those below zero (rounding's) taken as 0."""
    return float(np.sqrt(np.clip(np.linalg.eigvalsh((product + product.T) / 2), 0, None)).sum())


def fid_against_reference(features: Tensor, reference: Mapping[str, np.ndarray],
                          device: torch.device | str | None = None) -> float:
    """FID of (N, D) generated features against :func:`reference_statistics`' ``reference``:
    :func:`frechet_distance` of their :func:`fid_statistics`, computed on ``device`` where that is a CUDA device,
    the generated side has more images than features and the reference carries its ``"root"`` (the GAN's
    validation: 10,000 against the training split, D = 2048) (:func:`_fid_on_device`); elsewhere on the CPU."""
    n, d = features.shape if features.dim() == 2 else (0, 0)
    if device is None or torch.device(device).type != "cuda" or "root" not in reference or n <= d:
        return frechet_distance(fid_statistics(features), reference)
    return _fid_on_device(features, reference, device)


def _fid_on_device(features: Tensor, reference: Mapping[str, np.ndarray], device: torch.device | str) -> float:
    """:func:`frechet_distance` of :func:`fid_statistics` (N > D) against a reference with ``"root"`` R, in float64
    with torch on ``device``: mu and np.cov's covariance (ddof=1, centred, then one product), tr sqrt from
    ``eigvalsh(R.T sigma R)``, the same formula as the CPU's. Written here because the CPU's took 1.3 s (np.cov of
    10,000 x 2048) plus 1.7 s (two (D, D) products and an eigensolve) of one host thread at every validation while
    the GPU waited; on a GPU they are products of a few milliseconds and one symmetric eigensolve (cuSOLVER). NaN
    for non-finite features, as :func:`frechet_distance` gives; one read of the device for that and one for the
    score."""
    x = features.detach().to(device, torch.float64)                            # (N, D)
    if not bool(torch.isfinite(x).all()):
        return math.nan
    mu = x.mean(dim=0)                                                          # (D,)
    centred = x - mu
    sigma = centred.T @ centred / (x.shape[0] - 1)                              # (D, D), np.cov's (ddof=1)
    root = torch.as_tensor(np.asarray(reference["root"], dtype=np.float64)).to(device)      # (D, D)
    product = root.T @ sigma @ root                                             # (D, D), symmetric but for rounding
    tr_covmean = torch.linalg.eigvalsh((product + product.T) / 2).clamp_(min=0).sqrt_().sum()
    mu_ref = torch.as_tensor(np.asarray(reference["mu"], dtype=np.float64)).to(device)
    trace_ref = float(np.trace(np.asarray(reference["sigma"], dtype=np.float64)))
    diff = mu - mu_ref
    return float(diff @ diff + sigma.diagonal().sum() - 2 * tr_covmean) + trace_ref


def inception_score(logits: Tensor, splits: int = 1) -> tuple[float, float]:
    """(mean, std over splits) of the Inception Score of (N, 1008) ``logits_unbiased``.

    torch-fidelity's ``isc_features_to_metric`` with its defaults: samples
    shuffled with seed 2020 before splitting. ``splits=1`` gives std 0.
    """
    if splits < 1 or logits.dim() != 2 or logits.shape[0] < splits:
        raise UserError(
            f"The Inception Score over {splits} split(s) needs at least that many images and at least 1 split (logits "
            f"of shape {tuple(logits.shape)} were given); use more images or fewer splits."
        )
    out = isc_features_to_metric(logits.detach().cpu(), splits=splits, shuffle=True, rng_seed=ISC_RNG_SEED)
    return float(out[KEY_METRIC_ISC_MEAN]), float(out[KEY_METRIC_ISC_STD])


def kid_subset_size(requested: int | None, n_generated: int, n_reference: int) -> int:
    """The KID subset size used: ``requested``, or for None torch-fidelity's 1000 capped at both image counts.

    KID averages an unbiased estimator of the squared MMD, so a smaller subset
    changes only the spread of the estimate, not its expectation. A requested
    size above either count is a UserError naming ``metrics.kid_subset_size``.
    """
    if requested is None:
        return min(KID_SUBSET_SIZE, n_generated, n_reference)
    if requested < 2 or requested > min(n_generated, n_reference):
        raise UserError(
            f"metrics.kid_subset_size={requested} must be at least 2 and at most the number of images on each side "
            f"({n_generated} generated, {n_reference} reference): KID draws subsets of that many without "
            f"replacement. Lower it, raise the sample counts, or set it to null (torch-fidelity's 1000, capped at "
            f"the image counts)."
        )
    return requested


def kernel_inception_distance(
    generated: Tensor, reference: Tensor | np.ndarray, subsets: int = 100, subset_size: int | None = None,
    degree: int = 3, gamma: float | None = None, coef0: float = 1.0, device: torch.device | str | None = None,
) -> tuple[float, float]:
    """(mean, std over subsets) of KID between (N, D) generated and (M, D) reference pool features.

    torch-fidelity's ``kid_features_to_metric``: the unbiased squared MMD with
    the polynomial kernel ``(gamma x.y + coef0) ** degree`` (gamma None = 1/D),
    averaged over ``subsets`` pairs of subsets of ``subset_size`` images drawn
    without replacement by ``np.random.RandomState(2020)``. The kernels are
    computed in float64 (torch-fidelity's own pipeline passes its float32
    features, so its numpy arithmetic is float32: relative differences of
    ~1e-4, far below the spread over subsets). On a CUDA ``device`` they are
    computed there (:func:`_kid_on_device`); elsewhere (None, the CPU, and
    MPS, which has no float64) by torch-fidelity's function, whose numpy
    products are the faster on a CPU.
    """
    # The reference's pool features stay as the cache holds them (float32: 400 MB for 50,000 images, twice that as
    # a float64 copy at every validation); the rows drawn are made float64, exactly.
    generated, reference = generated.to(torch.float64), torch.as_tensor(reference)
    if subsets < 1:
        raise UserError(f"metrics.kid_subsets={subsets} must be >= 1 (torch-fidelity's default: 100).")
    size = kid_subset_size(subset_size, len(generated), len(reference))
    if device is not None and torch.device(device).type == "cuda":
        return _kid_on_device(generated, reference, subsets, size, degree, gamma, coef0, device)
    out = kid_features_to_metric(
        generated.detach().cpu(), reference.to(torch.float64).cpu(), kid_subsets=subsets, kid_subset_size=size,
        kid_kernel="poly", kid_kernel_poly_degree=degree, kid_kernel_poly_gamma=gamma, kid_kernel_poly_coef0=coef0,
        rng_seed=ISC_RNG_SEED, verbose=False,
    )
    return float(out[KEY_METRIC_KID_MEAN]), float(out[KEY_METRIC_KID_STD])


# The most bytes of the reference's pool features that KID on a GPU moves to the device whole (float32, as cached:
# 50,000 images at D = 2048 are 400 MB); a larger pool stays on the host and each pair's rows are moved alone.
KID_DEVICE_REFERENCE_BYTES = 2 << 30


def _kid_on_device(generated: Tensor, reference: Tensor, subsets: int, size: int, degree: int,
                   gamma: float | None, coef0: float, device: torch.device | str) -> tuple[float, float]:
    """:func:`kernel_inception_distance` with torch on ``device``: the same subsets (one RandomState seeded 2020,
    generated then reference indices for each pair, as torch-fidelity draws them), float64 kernels and unbiased
    estimator. Written here because torch-fidelity's runs in numpy on the CPU: its default, 100 pairs of 1,000 images
    at D = 2048, is 1.2 TFLOP of float64 products, tens of seconds of a host CPU at every validation while the GPU
    waits.

    Every pair's indices are drawn first and moved in one copy, and the reference's float32 features in one more
    (up to :data:`KID_DEVICE_REFERENCE_BYTES`; only the rows drawn are made float64), so the pairs' products queue
    without waiting on the host: each pair's two index copies and its host-gathered reference rows were copies that
    each waited for the pair before (200 small and 100 8-MB waits at the defaults). Generated features already on
    the device (the GAN's validation keeps them there) stay there. One read of the device at the end."""
    device = torch.device(device)
    generated = generated.detach().to(device)
    reference = reference.detach()
    gamma = 1.0 / generated.shape[1] if gamma is None else float(gamma)
    rng = np.random.RandomState(ISC_RNG_SEED)
    draws = [(rng.choice(len(generated), size, replace=False), rng.choice(len(reference), size, replace=False))
             for _ in range(subsets)]  # torch-fidelity's order: generated's draw, then the reference's, pair by pair
    generated_index = torch.from_numpy(np.stack([g for g, _ in draws])).to(device)  # (subsets, m)
    reference_index = torch.from_numpy(np.stack([r for _, r in draws]))  # (subsets, m)
    if reference.element_size() * reference.numel() <= KID_DEVICE_REFERENCE_BYTES:
        reference, reference_index = reference.to(device), reference_index.to(device)
    else:  # too large to move whole: each pair's rows gathered on the host
        reference = reference.cpu()

    def kernel(a: Tensor, b: Tensor) -> Tensor:  # (gamma a b.T + coef0) ** degree, in place: (m, m)
        return torch.addmm(a.new_full((), coef0), a, b.T, alpha=gamma).pow_(degree)

    def rows(features: Tensor, index: Tensor) -> Tensor:  # (m, D) float64 on the device: rows drawn where they are
        return features.index_select(0, index).to(device, torch.float64)

    mmds = []
    for pair in range(subsets):
        x, y = rows(generated, generated_index[pair]), rows(reference, reference_index[pair])
        k_xx, k_yy = kernel(x, x), kernel(y, y)
        off_diagonal = (k_xx.sum() - k_xx.diagonal().sum()) + (k_yy.sum() - k_yy.diagonal().sum())
        mmds.append(off_diagonal / (size * (size - 1)) - 2 * kernel(x, y).sum() / (size * size))
    values = torch.stack(mmds).cpu().numpy()
    return float(np.mean(values)), float(np.std(values))


# ---------------------------------------------------------------------------
# Reference statistics of the real images


def reference_statistics(
    extractor: torch.nn.Module,
    images_uint8: Tensor | Callable[[], Tensor],
    dataset_key: str,
    weights: str | None,
    cache_dir: str | Path | None,
    batch_size: int = 50,
    keep_features: bool = False,
) -> dict[str, np.ndarray]:
    """FID statistics of a real image set, cached as
    ``<cache_dir>/fid_ref_<dataset_key>_<weights_id>_<computation_id>.npz``.

    Returns ``{"mu": (D,), "sigma": (D, D)}`` in float64, for N <= D images
    :func:`fid_statistics`'s ``"factor"`` (rebuilt from the file's features on
    a hit: the same numbers), else ``"root"`` (:func:`covariance_root` of sigma,
    made once here for every score against it) and, with
    ``keep_features``, ``"features"``: the (N, D) pool features themselves, for
    KID. The file holds mu, sigma and the features (as float32, which is what
    the network computes, so nothing is lost); a cache file written before
    features were kept is recomputed when they are asked for.
    ``dataset_key`` must identify the exact image set (dataset, split, number of
    images, preprocessing): it is the cache key together with
    :func:`weights_id` of ``weights``, which must be the weights ``extractor``
    was built with, and :func:`computation_id` of the extractor as it is now
    (its device and dtype, the TF32 switches on CUDA): statistics computed
    under one arithmetic are never reused under another. Characters other than letters, digits, ``.``, ``_`` and
    ``-`` in the key are replaced by ``-`` in the file name. ``images_uint8``
    may be a callable, called only on a cache miss. ``cache_dir`` None
    disables caching. The file is written atomically (temp file + os.replace)
    and read back with ``allow_pickle=False``; an unreadable cache file is
    recomputed and replaced.
    """
    def read(f) -> dict[str, np.ndarray]:
        stats = {k: np.asarray(f[k], dtype=np.float64) for k in ("mu", "sigma")}
        if keep_features and "features" not in f.files:
            raise ValueError("written without the pool features that KID needs")
        d = stats["mu"].shape[0] if stats["mu"].ndim == 1 else -1
        if stats["sigma"].shape != (d, d):
            raise ValueError(f"mu {stats['mu'].shape} and sigma {stats['sigma'].shape} do not match")
        if "features" in f.files:
            features = np.asarray(f["features"])
            if features.ndim != 2 or features.shape[1] != d:
                raise ValueError(f"features {features.shape} do not match mu {stats['mu'].shape}")
            if keep_features:
                stats["features"] = features
            factor = covariance_factor(features)  # a miss's (fid_statistics), from the same float32 features
            if factor is not None:
                stats["factor"] = factor
        return with_root(stats)

    computation = extractor_computation_id(extractor)
    path = reference_cache_path(cache_dir, "fid", dataset_key, weights_id(weights), computation)
    stats = read_reference_cache(path, checked_computation(read, computation), "FID reference statistics",
                                 dataset_key)
    if stats is not None:
        return stats
    images = images_uint8() if callable(images_uint8) else images_uint8
    with torch.autocast(extractor_device(extractor).type, enabled=False):  # the arithmetic the key names
        features, _ = inception_features(extractor, images, batch_size=batch_size, progress=True)
    stats = with_root(fid_statistics(features))
    features32 = features.to(torch.float32).numpy()   # exact: the network's features are float32
    if path is not None:
        save_npz_atomically(path, mu=stats["mu"], sigma=stats["sigma"], features=features32,
                            computation=np.array(computation))
        log.info("FID reference statistics: cached %s", path)
    if keep_features:
        stats["features"] = features32
    return stats


def with_root(stats: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``stats`` with ``"root"`` (:func:`covariance_root`) where they have no low-rank ``"factor"``: the reference's
    form for :func:`frechet_distance` (a hit and a miss make it from the same float64 sigma, to the same bits)."""
    if "factor" not in stats and np.isfinite(stats["sigma"]).all():
        stats["root"] = covariance_root(stats["sigma"])
    return stats


def computation_id(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """What decides the numbers an extractor computes besides its weights and its input, for cache keys:
    ``<device type>-<dtype>``, on CUDA the TF32 switches as torch has them now (``mm-<float32 matmul precision>``:
    highest, high or medium, which ``torch.backends.cuda.matmul.allow_tf32`` and ``trainer.tf32`` set; ``conv-tf32``
    or ``conv-ieee``, ``torch.backends.cudnn.allow_tf32``, or ``conv-nocudnn`` with cuDNN off), and torch-fidelity's
    version (its network and resizing code). TF32 moves Inception's pool features by ~1e-4 relative, which FID
    differences between variants are of the order of. On a CPU the switches change nothing (torch: "this flag
    currently only affects ... CUDA"), so CPU runs share one key whatever ``trainer.tf32`` says.

    Not in the key: the batch size and cuDNN's algorithm choice (``trainer.deterministic``, the GPU model), which
    move features by float32 rounding only, as run-to-run noise on a GPU does."""
    device_type = torch.device(device).type
    parts = [device_type, str(dtype).removeprefix("torch.")]
    if device_type == "cuda":
        parts.append(f"mm-{torch.get_float32_matmul_precision()}")
        if not torch.backends.cudnn.enabled:
            parts.append("conv-nocudnn")
        else:
            parts.append("conv-tf32" if torch.backends.cudnn.allow_tf32 else "conv-ieee")
    parts.append(f"tfid{torch_fidelity.__version__}")
    return "-".join(parts)


def extractor_device(extractor: torch.nn.Module) -> torch.device:
    """The device an extractor computes on: its parameters'."""
    return next(extractor.parameters()).device


def extractor_computation_id(extractor: torch.nn.Module) -> str:
    """:func:`computation_id` of an extractor as it is now: its parameters' device and dtype (float32 unless
    torch-fidelity's ``feature_extractor_internal_dtype`` says float64)."""
    param = next(extractor.parameters())
    return computation_id(param.device, param.dtype)


def checked_computation(read: Callable, computation: str) -> Callable:
    """``read`` of a cache file that first checks the computation the file records, where it records one (the
    name holds it too): a file renamed or copied from another key's name is recomputed, not reused."""
    def checked(f):
        if "computation" in f.files and (stored := str(f["computation"])) != computation:
            raise ValueError(f"computed under {stored}, not {computation}")
        return read(f)

    return checked


def reference_cache_path(cache_dir: str | Path | None, prefix: str, dataset_key: str, weights: str,
                         computation: str) -> Path | None:
    """``<cache_dir>/<prefix>_ref_<dataset_key>_<weights>_<computation>.npz`` (None without a cache directory),
    ``weights`` the extractor's weights id, ``computation`` its :func:`computation_id`; characters other than
    letters, digits, ``.``, ``_`` and ``-`` in the key become ``-``."""
    if cache_dir is None:
        return None
    safe_key = re.sub(r"[^A-Za-z0-9._-]", "-", dataset_key)
    safe_computation = re.sub(r"[^A-Za-z0-9._-]", "-", computation)
    return Path(cache_dir) / f"{prefix}_ref_{safe_key}_{weights}_{safe_computation}.npz"


def read_reference_cache(path: Path | None, read: Callable, what: str, dataset_key: str,
                         logger: logging.Logger = log):
    """``read(npz)`` of the cache file at ``path``, or None on a miss. ``read`` raises for a file it cannot use
    (corrupt, foreign, older layout): that file is logged (to ``logger``) and recomputed rather than failing
    the run."""
    if path is None:
        logger.info("%s: no cache directory, computing for %s", what, dataset_key)
        return None
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                value = read(f)
            logger.info("%s: cache hit, loaded %s", what, path)
            return value
        except Exception as e:  # corrupt / foreign / older file: recompute rather than fail the run
            logger.warning("%s: ignoring unreadable cache file %s (%s); recomputing", what, path, e)
    logger.info("%s: cache miss, computing %s", what, path)
    return None


def save_npz_atomically(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` to a temporary file beside ``path``, then ``os.replace``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:   # a file object: np.savez would append ".npz" to a name
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
