"""Image classification data modules (``task=classification``), one data set per module.

``imagenet`` -> :class:`ImageNet`, ``folder_cls`` -> :class:`FolderClassification`, ``cifar10_cls`` ->
:class:`CIFAR10Classification`, ``cifar100`` -> :class:`CIFAR100` (both on :class:`CIFARClassification`),
``tiny`` -> :class:`TinyDigits`; all on :class:`ClassificationDataModule`, whose docstring gives the batches,
the augmentation and the bad-file policy. Raw formats are read by :mod:`datamodules.formats`.
"""

from datamodules.base import IMAGENET_MEAN, IMAGENET_STD
from datamodules.classification.base import (ArraySource, ClassificationDataModule, ClassificationDataset,
                                             FileSource, collate)
from datamodules.classification.cifar import CIFARClassification
from datamodules.classification.cifar10 import CIFAR10Classification
from datamodules.classification.cifar100 import CIFAR100
from datamodules.classification.folder import FolderClassification
from datamodules.classification.imagenet import ImageNet
from datamodules.classification.tiny import TinyDigits

__all__ = ["CIFAR100", "IMAGENET_MEAN", "IMAGENET_STD", "ArraySource", "CIFAR10Classification",
           "CIFARClassification", "ClassificationDataModule", "ClassificationDataset", "FileSource",
           "FolderClassification", "ImageNet", "TinyDigits", "collate"]  # fmt: skip
