"""The old import path of the data-module option checks, which live in :mod:`datamodules.base`.

Kept while ``suite/schema.py`` and ``tests/test_config_checks.py`` still import ``ON_BAD_FILE`` from here;
once they import it from :mod:`datamodules.base`, this module can go.
"""

from datamodules.base import ON_BAD_FILE, int_option, on_bad_file_option

__all__ = ["ON_BAD_FILE", "int_option", "on_bad_file_option"]
