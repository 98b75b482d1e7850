"""Readers of raw data formats, one module per format, shared by every data module that reads it.

A reader checks what it reads and raises :class:`datamodules.base.DataError` (or a UserError) naming the
file, what is wrong and how to get a good file; what to do with a bad file (``data.on_bad_file``) is the
data module's business (:class:`datamodules.base.BadFiles`).
"""
