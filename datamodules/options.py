"""Option checks of data modules: they live in :mod:`datamodules.base`; this module keeps the old import
path working for modules not yet moved onto the base."""

from datamodules.base import ON_BAD_FILE, int_option, on_bad_file_option

__all__ = ["ON_BAD_FILE", "int_option", "on_bad_file_option"]
