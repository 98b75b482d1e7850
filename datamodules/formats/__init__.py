"""Readers of raw data formats, one module per format, shared by every data module that reads it.

A reader checks what it reads and raises :class:`datamodules.base.DataError` (or a UserError) naming the
file, what is wrong and how to get a good file; what to do with a bad file (``data.on_bad_file``) is the
data module's business (:class:`datamodules.base.BadFiles`).

- :mod:`.h5`: the HDF5 releases of ModelNet40 and ShapeNetPart;
- :mod:`.pyg`: torch-geometric's processed ModelNet40 and ShapeNet;
- :mod:`.shapenet_txt`: ShapeNetPart's per-shape text files;
- :mod:`.cifar`: the CIFAR-10/100 python releases (GAN and classification alike);
- :mod:`.digits`: scikit-learn's 8x8 digits;
- :mod:`.image_folder`: folders of image files (listing, decoding, checking, cropping).
"""
