"""``data=cifar100``: CIFAR-100's 100 fine classes for classification."""

from __future__ import annotations

from datamodules.classification.cifar import CIFARClassification
from datamodules.formats import cifar


class CIFAR100(CIFARClassification):
    """CIFAR-100, python release: ``<root>/cifar-100-python/{train, test, meta}``, pickled dicts with
    ``b"data"`` (n, 3072) uint8 and ``b"fine_labels"``; the 100 fine classes, named by ``meta``'s
    ``b"fine_label_names"`` (see :class:`CIFARClassification`)."""

    name = "CIFAR-100"
    release = cifar.CIFAR100
