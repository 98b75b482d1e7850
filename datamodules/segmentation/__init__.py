"""Semantic-segmentation data modules: VOC, ADE20K, Cityscapes and GID in their official
on-disk layouts (no downloads), and Blobs, generated in memory; one dataset per module.

Right after construction every module has ``num_classes``, ``class_names``,
``ignore_index`` (255), ``mean`` / ``std`` (ImageNet, for normalisation),
``palette`` (uint8 (K, 3) numpy colours, for visualisation), ``crop`` ((h, w))
and ``lr`` (the dataset's recipe learning rate; the task reads it).
:meth:`SegDataModule.setup` builds ``train_set``, ``val_set`` and ``test_set``
(``test_set is val_set`` for VOC, ADE20K and Cityscapes, which have no public
test labels). Batches are dicts::

    train       {"image": float32 (B, 3, ch, cw), "mask": int64 (B, ch, cw)}
    val / test  {"image": float32 (B, 3, H, W),   "mask": int64 (B, H, W)}

Masks hold class indices in [0, num_classes) or 255 (ignored). Images are
``(pixel / 255 - mean) / std``.

Training transforms, on tensors, per sample (:class:`TrainTransform`):

1. a random scale s ~ U(scale_range) of the whole image: bilinear for the image,
   nearest (``nearest-exact``: same pixel centres as bilinear) for the mask;
2. padding at the bottom / right to at least the crop: image with 0 (black,
   before normalisation), mask with 255;
3. a random ``crop`` window;
4. a horizontal flip with probability 1/2 (``flip``), of image and mask together;
5. normalisation.

The random numbers come from torch's default generator in the process that
loads the sample (the main process, or a DataLoader worker, which DataLoader
seeds from the main process), so ``lightning.seed_everything`` makes the batches
reproducible. Evaluation samples are whole images in a fixed order, not
augmented; with ``eval_batch_size > 1``, :class:`PadCollate` pads the images of
a batch to the largest one (black, i.e. ``-mean / std`` after normalisation;
masks 255) and lists their sizes, by which the task predicts each image of a
padded batch at its own size (the scores do not depend on the batch size).

Files are decoded with PIL in :meth:`SegmentationDataset.__getitem__`, i.e. in
the DataLoader workers. :meth:`SegDataModule.setup` only does the cheap checks:
the dataset folders and split files exist, every image has its mask and every
mask its image, split files name existing files, and every image and mask opens
(its header: a known image format, a single-channel 8-bit mask, image and mask of
the same size). With ``on_bad_file="error"`` (the default) the first problem
raises a :class:`~attention.errors.UserError`; with ``"skip"`` the bad samples are
dropped, listed in ``skipped`` (one line each, ``"<file>: <what is wrong>"``) and
reported in one warning per check (:class:`datamodules.base.BadFiles`). ``__getitem__`` checks each sample it decodes (pixel data
truncated or corrupt, a label value outside the dataset's range) and raises a
UserError naming the file; those are only found when the sample is loaded, so they
raise even with ``on_bad_file="skip"``. GID decodes every tile in ``setup`` (to cut
patches), so there all problems are setup problems.

Layout: :mod:`~datamodules.segmentation.base` (:class:`SegDataModule`), :mod:`~.transforms` (training
transforms, normalisation, :class:`PadCollate`), :mod:`~.sources` (file pairs or arrays, and
:class:`SegmentationDataset`), :mod:`~.files` (decoding and folder look-ups), :mod:`~.labels` (mask values);
one module per dataset: :mod:`~.voc`, :mod:`~.ade20k`, :mod:`~.cityscapes`, :mod:`~.gid`, :mod:`~.blobs`.
A new dataset is one such module (what it declares: :mod:`~.base`) and one ``configs/data/<name>.yaml`` whose
``_target_`` names its class by its module path (``datamodules.segmentation.<module>.<Class>``, as the shipped
ones do; those are also exported here and by :mod:`datamodules`, for imports in Python).
"""

from datamodules.base import DECODE_ERRORS, IMAGENET_MEAN, IMAGENET_STD
from datamodules.segmentation.ade20k import ADE20K, ADE20K_CLASSES, ADE20K_LABELS
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.blobs import BLOBS_CLASSES, BLOBS_PALETTE, Blobs, blob_sample
from datamodules.segmentation.cityscapes import (CITYSCAPES_CLASSES, CITYSCAPES_LABEL_IDS, CITYSCAPES_LABEL_TRAIN_IDS,
                                                 CITYSCAPES_PALETTE, CITYSCAPES_TRAIN_IDS, Cityscapes)
from datamodules.segmentation.files import MASK_MODES, header_problem, read_image, read_index_mask
from datamodules.segmentation.gid import GID, GID_CLASSES, GID_PALETTE, gid_colours_to_index
from datamodules.segmentation.labels import IGNORE_INDEX, LabelMap, bit_colormap
from datamodules.segmentation.sources import ArraySource, FileSource, SegmentationDataset
from datamodules.segmentation.transforms import PadCollate, TrainTransform, normalize
from datamodules.segmentation.voc import VOC, VOC_CLASSES, VOC_LABELS

__all__ = [
    "ADE20K", "ADE20K_CLASSES", "ADE20K_LABELS", "ArraySource", "BLOBS_CLASSES", "BLOBS_PALETTE", "Blobs",
    "CITYSCAPES_CLASSES", "CITYSCAPES_LABEL_IDS", "CITYSCAPES_LABEL_TRAIN_IDS", "CITYSCAPES_PALETTE",
    "CITYSCAPES_TRAIN_IDS", "Cityscapes", "DECODE_ERRORS", "FileSource", "GID", "GID_CLASSES", "GID_PALETTE",
    "IGNORE_INDEX", "IMAGENET_MEAN", "IMAGENET_STD", "LabelMap", "MASK_MODES", "PadCollate", "SegDataModule",
    "SegmentationDataset", "TrainTransform", "VOC", "VOC_CLASSES", "VOC_LABELS", "bit_colormap", "blob_sample",
    "gid_colours_to_index", "header_problem", "normalize", "read_image", "read_index_mask",
]  # fmt: skip
