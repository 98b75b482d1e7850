"""Point-cloud classification (samples ``{"points", "label"}``): the base in :mod:`datamodules.points.base`,
one data set per module, shared point operations in :mod:`datamodules.points.ops`."""

from datamodules.points.base import PointCloudDataModule, PointCloudDataset
from datamodules.points.modelnet40 import ModelNet40
from datamodules.points.modelnet40_pyg import ModelNet40PyG
from datamodules.points.shapes import Shapes

__all__ = ["ModelNet40", "ModelNet40PyG", "PointCloudDataModule", "PointCloudDataset", "Shapes"]
