"""Point-cloud classification data modules (Lightning), configured from Hydra.

Config name -> class: ``modelnet40`` -> :class:`ModelNet40`,
``modelnet40_pyg`` -> :class:`ModelNet40PyG`, ``shapes`` -> :class:`Shapes`.
"""

from datamodules.download import download_and_extract
from datamodules.modelnet import ModelNet40, ModelNet40PyG
from datamodules.points import PointCloudDataModule, PointCloudDataset
from datamodules.shapes import Shapes

__all__ = [
    "ModelNet40",
    "ModelNet40PyG",
    "PointCloudDataModule",
    "PointCloudDataset",
    "Shapes",
    "download_and_extract",
]
