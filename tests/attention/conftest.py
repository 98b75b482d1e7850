import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny tensors: every module here runs with one intra-op thread (tests/conftest.py)."""
