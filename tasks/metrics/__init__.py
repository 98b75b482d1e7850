"""The metrics of the tasks: part-segmentation IoU (``part_iou``), semantic segmentation (``segmentation``),
FID/IS/KID through torch-fidelity (``fid``), mean class accuracy (``classification``)."""
