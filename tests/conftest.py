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


@pytest.fixture
def no_compile(monkeypatch, launches):
    """compile() builds and loads nothing (a test module's ``launches`` fixture stands in
    for the kernels): for the allocating functions and custom ops on the CPU."""
    from precast.lifecycle.op import Op

    def compile(self, arch=None, cache=None):
        self._kernels, self._arch = {}, "sm_90a"
        return self
    monkeypatch.setattr(Op, "compile", compile)
    return launches


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


# --- CPU tests of ops' host sides: no kernel is built or loaded ---------------------------------
def isolate_from_kernels(monkeypatch, tmp_path):
    """Nothing may build or load kernels (a temporary cache, Op._ready refuses), the
    allocating functions start with no compiled ops, and cutlass cannot be imported (the
    host that executes has no compiler): neither it nor a kernel module that imports it,
    even one an earlier test loaded."""
    import sys

    from precast.lifecycle.op import Op
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path / "cache"))
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "cutlass" or (
                name.startswith("precast.kernels.") and hasattr(module, "cutlass")):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cutlass", None)

    def no_kernels(self, device_index):
        raise AssertionError("test reached kernel loading")
    monkeypatch.setattr(Op, "_ready", no_kernels)
    monkeypatch.setattr(sys.modules["precast.op_cache"], "_ops", {})


SIDE_OFFSET = 1000  # record_launches: a side stream's stand-in handle, the caller's + this


def record_launches(monkeypatch, module, kernel_modes, alloc: str):
    """Stands in for what an op's execute() does on the device (``module``: the op's
    lifecycle module, or a tuple of the modules its torch-side work runs in) and records
    it, in order, in ``events``:
    - each kernel launch: its mode (also with the arguments in ``calls``); ``effects[mode]``
      runs inside it; ``ready`` lists the device indices kernels were loaded for;
    - the stream contexts of torch-side work (launch.torch_stream and torch.cuda.stream as
      the module sees them);
    - allocations of the op's own workspace (``torch.<alloc>`` for cuda:N, made on
      ``alloc_device`` here; the requested device goes to ``alloc_devices``);
    - Tensor.copy_ and Tensor.zero_.
    stream_is_capturing answers ``capturing`` and records the handle in ``capture_queries``;
    launch.side_stream's fork and join record ("fork", handle) and ("join", handle), and a
    forked launch runs on handle + SIDE_OFFSET.
    ``kernel_modes(op)``: the modes an op loads."""
    import types

    from precast.lifecycle.op import Op
    rec = types.SimpleNamespace(calls=[], events=[], effects={}, capturing=False,
                                capture_queries=[], alloc_device="meta", alloc_devices=[],
                                ready=[])

    def ready(self, device_index):
        rec.ready.append(device_index)

        def kernel(mode):
            def launch(*args):
                rec.calls.append((mode, args))
                rec.events.append(("launch", mode))
                if mode in rec.effects:
                    rec.effects[mode](args)
            return launch
        return {mode: kernel(mode) for mode in kernel_modes(self)}
    monkeypatch.setattr(Op, "_ready", ready)

    class ExternalStream:
        def __init__(self, handle, device=None):
            self.handle, self.device = handle, device

    @contextlib.contextmanager
    def stream(s):
        rec.events.append(("stream", s.handle, s.device))
        yield
        rec.events.append(("end stream",))

    def allocate(shape, dtype=None, device=None):
        rec.events.append((alloc, tuple(shape), dtype))
        rec.alloc_devices.append(device)
        return getattr(torch, alloc)(shape, dtype=dtype, device=rec.alloc_device)

    class ModuleTorch:  # torch as the op's module sees it
        cuda = types.SimpleNamespace(stream=stream)

        def __getattr__(self, name):
            return getattr(torch, name)
    setattr(ModuleTorch, alloc, staticmethod(allocate))

    def is_capturing(handle):
        rec.capture_queries.append(handle)
        return rec.capturing

    class SideStream:
        def __init__(self, device_index, handle):
            pass

        def fork(self, handle):
            rec.events.append(("fork", handle))
            return handle + SIDE_OFFSET

        def join(self, handle):
            rec.events.append(("join", handle))
    for m in module if isinstance(module, tuple) else (module,):
        monkeypatch.setattr(m, "torch", ModuleTorch())
        monkeypatch.setattr(m, "torch_stream", ExternalStream)
        if hasattr(m, "stream_is_capturing"):
            monkeypatch.setattr(m, "stream_is_capturing", is_capturing)
        if hasattr(m, "side_stream"):
            monkeypatch.setattr(m, "side_stream", SideStream)

    copy_, zero_ = torch.Tensor.copy_, torch.Tensor.zero_

    def record_copy(t, src, *args, **kw):
        rec.events.append(("copy", t, src))
        return copy_(t, src, *args, **kw)

    def record_zero(t):
        rec.events.append(("zero", t))
        return zero_(t)
    monkeypatch.setattr(torch.Tensor, "copy_", record_copy)
    monkeypatch.setattr(torch.Tensor, "zero_", record_zero)
    return rec
