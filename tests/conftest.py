import os

import pytest
import torch

GPU_AVAILABLE = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an SM90 GPU and precompiled artifacts")
    config.addinivalue_line("markers", "compile: cross-compiles kernels (needs nvidia-cutlass-dsl)")


def pytest_collection_modifyitems(config, items):
    if GPU_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _default_arch():
    # CPU machines compile for Hopper unless told otherwise.
    if not GPU_AVAILABLE:
        os.environ.setdefault("PRECAST_ARCH", "sm_90a")
    yield
