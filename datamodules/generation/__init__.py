"""Image-generation (GAN) data modules: the training split in memory, one data set per module.

``digits`` -> :class:`Digits` (scikit-learn's digits, offline), ``cifar10`` -> :class:`CIFAR10` (the python
release), ``image_folder`` -> :class:`ImageFolder` (any folder of images); all on :class:`ImageDataModule`,
whose docstring gives the batches and the bad-file policy. Raw formats are read by :mod:`datamodules.formats`.
"""

from datamodules.generation.base import ImageDataModule
from datamodules.generation.cifar10 import CIFAR10
from datamodules.generation.digits import Digits
from datamodules.generation.image_folder import ImageFolder

__all__ = ["CIFAR10", "Digits", "ImageDataModule", "ImageFolder"]
