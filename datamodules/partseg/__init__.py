"""Part segmentation (samples ``{"points", "parts", "category"[, "normals"]}``): the base in
:mod:`datamodules.partseg.base`, ShapeNetPart's shared tables in :mod:`datamodules.partseg.shapenet`, one
data set per module."""

from datamodules.partseg.base import PartDataset, PartSegDataModule
from datamodules.partseg.parts import Parts
from datamodules.partseg.shapenet_part import ShapeNetPart
from datamodules.partseg.shapenet_part_h5 import ShapeNetPartH5
from datamodules.partseg.shapenet_part_pyg import ShapeNetPartPyG

__all__ = ["PartDataset", "PartSegDataModule", "Parts", "ShapeNetPart", "ShapeNetPartH5", "ShapeNetPartPyG"]
