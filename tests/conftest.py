"""Test-wide settings: one torch thread (on 2-core machines tiny-model tests run several times faster)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
