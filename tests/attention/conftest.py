import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: on a busy 2-core machine intra-op threads only add spin-waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
