"""Improved precision and recall (Kynkäänniemi et al. 2019) for the GAN task, with torch-fidelity's VGG16.

Everything numerical is torch-fidelity's own code: the feature extractor
(``FeatureExtractorVGG16``, registered as ``vgg16``: torchvision's VGG16 with
the last classifier layers removed, inputs resized to 224x224 with the
TF1-compatible bilinear resize; features ``fc2_relu``, its default for PRC)
and ``prc_features_to_metric`` (the k-nearest-neighbour manifolds: a sample is
inside the other set's manifold when it is within the k-th neighbour distance
of one of its members; precision = generated samples inside the real manifold,
recall = real samples inside the generated one). torch-fidelity takes the
features as tensors, so nothing of the formula is rewritten here. This module
adds what :mod:`tasks.metrics.fid` adds for Inception: loading the weights
(``metrics.vgg16_weights``: torchvision's ImageNet weights fetched once into
torch hub's cache, a vetted local file, or ``random[:SEED]`` for offline smoke
runs) and a cache of the real set's features.

Numbers from random weights or few samples are not comparable with published ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import torch_fidelity.feature_extractor_vgg16 as _tf_vgg16
import torchvision
from torch import Tensor
from torch_fidelity.defaults import DEFAULTS
from torch_fidelity.feature_extractor_vgg16 import FeatureExtractorVGG16
from torch_fidelity.metric_prc import KEY_METRIC_F_SCORE, KEY_METRIC_PRECISION, KEY_METRIC_RECALL, \
    prc_features_to_metric

from attention.errors import UserError

from . import fid
from .extractor_weights import ExtractorWeights

log = logging.getLogger(__name__)

EXTRACTOR_NAME = "vgg16"
FEATURE = "fc2_relu"                     # torch-fidelity's default layer of vgg16 for PRC
URL_VGG16 = torchvision.models.VGG16_Weights.IMAGENET1K_V1.url   # what torch-fidelity downloads
OFFICIAL_WEIGHTS_ID = "vgg16-imagenet1k-v1"
PRC_BATCH_SIZE = DEFAULTS["prc_batch_size"]   # 10000 rows per block of distances

_EXTRACTORS: dict[object, FeatureExtractorVGG16] = {}
_BUILD_LOCK = threading.Lock()


VGG16 = ExtractorWeights("metrics.vgg16_weights", URL_VGG16, OFFICIAL_WEIGHTS_ID, "torchvision's VGG16 weights",
                         "precision/recall", off="metrics.prc=false")
hub_weights_path, weights_id = VGG16.hub_path, VGG16.id


def random_state_dict(seed: int) -> dict[str, Tensor]:
    """torchvision's own VGG16 initialisation (Kaiming convolutions, N(0, 0.01) linears) drawn from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torchvision.models.vgg16().state_dict()


def _construct(state_dict: Mapping[str, Tensor] | None) -> FeatureExtractorVGG16:
    """torch-fidelity's extractor with ``state_dict`` (None: torchvision's download, torch-fidelity's default).

    Given a path, torch-fidelity would unpickle it with ``weights_only=False``;
    instead its module-global ``torchvision_load_pretrained_vgg16`` is swapped,
    under a lock, for a function returning a VGG16 holding the dict already
    loaded and vetted (as :func:`tasks.metrics.fid._construct` does for Inception).
    """
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        if state_dict is None:
            return FeatureExtractorVGG16(EXTRACTOR_NAME, [FEATURE], verbose=True)

        def load_pretrained(**kwargs):  # noqa: ARG001 - torch-fidelity's signature
            with torch.device("meta"):
                model = torchvision.models.vgg16()
            model.load_state_dict(state_dict, assign=True)
            return model

        saved = _tf_vgg16.torchvision_load_pretrained_vgg16
        _tf_vgg16.torchvision_load_pretrained_vgg16 = load_pretrained
        try:
            return FeatureExtractorVGG16(EXTRACTOR_NAME, [FEATURE])
        finally:
            _tf_vgg16.torchvision_load_pretrained_vgg16 = saved


def _expected() -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in torchvision.models.vgg16().state_dict().items()}


def load_vgg16(weights: str | None = None) -> torch.nn.Module:
    """torch-fidelity's ``vgg16`` extractor of ``fc2_relu``, eval mode, no grad, on CPU, cached per weights choice.

    ``weights``: None fetches torchvision's ImageNet weights once into torch hub's cache (torch-fidelity's
    default); a path loads that file, vetted; ``"random"`` / ``"random:SEED"`` is :func:`random_state_dict`, for
    offline smoke runs and tests only (:mod:`.extractor_weights`).
    """
    return VGG16.load(weights, _EXTRACTORS, _construct, random_state_dict, _expected,
                      hint=" Use the torchvision file, not another VGG port.")


@torch.no_grad()
def vgg16_features(extractor: torch.nn.Module, images_uint8: Tensor, batch_size: int = 50,
                   progress: bool = False, keep_on_device: bool = False) -> Tensor:
    """``fc2_relu`` features (N, 4096) of uint8 (N, 3, H, W) images, float32 (the network's own) on CPU (with
    ``keep_on_device``, on the extractor's device, as :func:`tasks.metrics.fid.inception_features` keeps them).

    Single-channel images are replicated to RGB, as for Inception.
    """
    fid._check_uint8_images(images_uint8, "vgg16_features", channels=(1, 3))
    to = fid.extractor_device(extractor) if keep_on_device else torch.device("cpu")
    out = []
    for batch in fid.rgb_batches(extractor, images_uint8, batch_size, progress, "VGG16 features"):
        (features,) = extractor(batch)
        out.append(features.to(to, torch.float32))
    return torch.cat(out) if out else torch.empty(0, 4096, device=to)


def precision_recall(generated: Tensor, real: Tensor, neighborhood: int = 3,
                     batch_size: int = PRC_BATCH_SIZE) -> tuple[float, float, float]:
    """(precision, recall, F-score) of (N, D) generated against (M, D) real features: ``prc_features_to_metric``.

    Computed on the features' device in blocks of ``batch_size`` rows
    (torch-fidelity's ``save_cpu_ram`` route: the same distances and
    comparisons as its default route without holding the M x M matrix).
    """
    if neighborhood < 1 or neighborhood >= min(len(generated), len(real)):
        raise UserError(
            f"metrics.prc_neighborhood={neighborhood} must be at least 1 and below the number of images on each side "
            f"({len(generated)} generated, {len(real)} real): the radius of a sample is the distance to its k-th "
            f"nearest other sample. Lower it or use more samples (the paper's k is 3)."
        )
    out = prc_features_to_metric(generated, real.to(generated.device), prc_neighborhood=neighborhood,
                                 prc_batch_size=batch_size, save_cpu_ram=True, verbose=False)
    return float(out[KEY_METRIC_PRECISION]), float(out[KEY_METRIC_RECALL]), float(out[KEY_METRIC_F_SCORE])


def reference_features(
    extractor: torch.nn.Module, images_uint8: Tensor | Callable[[], Tensor], dataset_key: str,
    weights: str | None, cache_dir: str | Path | None, batch_size: int = 50,
) -> Tensor:
    """VGG16 features of the real images, cached as
    ``<cache_dir>/prc_ref_<dataset_key>_<weights_id>_<computation_id>.npz``.

    The same keys and atomic writes as :func:`tasks.metrics.fid.reference_statistics`.
    """
    def read(f) -> Tensor:
        features = torch.from_numpy(np.asarray(f["features"], dtype=np.float32))
        if features.ndim != 2:
            raise ValueError(f"features of shape {tuple(features.shape)}")
        return features

    computation = fid.extractor_computation_id(extractor)
    path = fid.reference_cache_path(cache_dir, "prc", dataset_key, weights_id(weights), computation)
    features = fid.read_reference_cache(path, fid.checked_computation(read, computation), "PRC reference features",
                                        dataset_key, log)
    if features is not None:
        return features
    images = images_uint8() if callable(images_uint8) else images_uint8
    with torch.autocast(fid.extractor_device(extractor).type, enabled=False):  # the arithmetic the key names
        features = vgg16_features(extractor, images, batch_size=batch_size, progress=True)
    if path is not None:
        fid.save_npz_atomically(path, features=features.numpy(), computation=np.array(computation))
        log.info("PRC reference features: cached %s", path)
    return features
