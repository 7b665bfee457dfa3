import contextlib
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


@pytest.fixture(scope="module")
def fp32_matmuls():
    """References' einsums on the GPU in true fp32 (no TF32), for a whole test module."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def fixed_sources(monkeypatch):
    """Cache keys that differ by static configuration only (the kernel-source fingerprint
    pinned)."""
    from precast.lifecycle import op as op_mod
    monkeypatch.setattr(op_mod, "source_fingerprint", lambda modules: "sources")


def key_of(op):
    return op.check_support().cache_key("sm_90a")


@pytest.fixture(autouse=True, scope="session")
def _default_arch():
    # CPU machines compile for Hopper unless told otherwise.
    if not GPU_AVAILABLE:
        os.environ.setdefault("PRECAST_ARCH", "sm_90a")
    yield


@contextlib.contextmanager
def streams_of_every_kind():
    """A torch stream, a cuda-python CUstream, its int handle and (when cuda.core is there) a
    cuda.core stream; the CUstream is destroyed on exit, after a device synchronize."""
    from cuda.bindings import driver

    from precast.graphs import check, ensure_context
    ensure_context()
    cu_stream = check(driver.cuStreamCreate(0))
    streams = [torch.cuda.Stream(), cu_stream, int(cu_stream)]
    try:
        from cuda.core import Device
        dev = Device()
        dev.set_current()
        streams.append(dev.create_stream())
    except Exception:  # cuda.core absent or too old: the other kinds still run
        pass
    try:
        yield streams
    finally:
        torch.cuda.synchronize()
        check(driver.cuStreamDestroy(cu_stream))
