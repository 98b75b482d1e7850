"""Data modules (Lightning), configured from Hydra; every one is a :class:`datamodules.base.DataModule`.

Point-cloud classification (samples ``{"points", "label"}``, see :mod:`datamodules.points`):
``modelnet40`` -> :class:`ModelNet40`, ``modelnet40_pyg`` -> :class:`ModelNet40PyG`,
``shapes`` -> :class:`Shapes`.

Part segmentation (samples ``{"points", "parts", "category"[, "normals"]}``, see
:mod:`datamodules.partseg`): ``shapenet_part`` -> :class:`ShapeNetPart`,
``shapenet_part_h5`` -> :class:`ShapeNetPartH5`, ``shapenet_part_pyg`` ->
:class:`ShapeNetPartPyG`, ``parts`` -> :class:`Parts`.

Image generation (training split in memory, batches ``{"image", "label"}``, see
:mod:`datamodules.generation`): ``digits`` -> :class:`Digits`, ``cifar10`` ->
:class:`CIFAR10`, ``image_folder`` -> :class:`ImageFolder` (base :class:`ImageDataModule`).

Image classification (batches ``{"image", "label"}``, see :mod:`datamodules.classification`):
``imagenet`` -> :class:`ImageNet`, ``folder_cls`` -> :class:`FolderClassification`, ``cifar10_cls`` ->
:class:`CIFAR10Classification`, ``cifar100`` -> :class:`CIFAR100`, ``tiny`` -> :class:`TinyDigits`
(base :class:`ClassificationDataModule`).

Semantic segmentation (``{"image", "mask"}``, :mod:`datamodules.segmentation`): voc, ade20k, cityscapes, gid, blobs.

The exports below are for imports in Python (``from datamodules import Shapes``); configs name each class by its
module path (``_target_: datamodules.points.shapes.Shapes``), so a new data set needs no line here.
"""

from datamodules.classification import (CIFAR100, CIFAR10Classification, ClassificationDataModule,
                                        FolderClassification, ImageNet, TinyDigits)
from datamodules.download import download_and_extract
from datamodules.generation import CIFAR10, Digits, ImageDataModule, ImageFolder
from datamodules.partseg import PartDataset, PartSegDataModule, Parts, ShapeNetPart, ShapeNetPartH5, ShapeNetPartPyG
from datamodules.points import ModelNet40, ModelNet40PyG, PointCloudDataModule, PointCloudDataset, Shapes
from datamodules.segmentation import ADE20K, GID, VOC, Blobs, Cityscapes, SegDataModule

__all__ = [
    "ADE20K",
    "Blobs",
    "CIFAR10",
    "CIFAR100",
    "CIFAR10Classification",
    "ClassificationDataModule",
    "Cityscapes",
    "Digits",
    "FolderClassification",
    "GID",
    "ImageDataModule",
    "ImageFolder",
    "ImageNet",
    "ModelNet40",
    "ModelNet40PyG",
    "PartDataset",
    "PartSegDataModule",
    "Parts",
    "PointCloudDataModule",
    "PointCloudDataset",
    "SegDataModule",
    "ShapeNetPart",
    "ShapeNetPartH5",
    "ShapeNetPartPyG",
    "Shapes",
    "TinyDigits",
    "VOC",
    "download_and_extract",
]
