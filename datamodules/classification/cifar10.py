"""``data=cifar10_cls``: CIFAR-10 for classification (``data=cifar10`` is the GAN's)."""

from __future__ import annotations

from datamodules.classification.cifar import CIFARClassification
from datamodules.formats import cifar


class CIFAR10Classification(CIFARClassification):
    """CIFAR-10, python release: ``<root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``;
    the five data batches train, ``test_batch`` validates and tests (see :class:`CIFARClassification`)."""

    name = "CIFAR-10"
    release = cifar.CIFAR10
