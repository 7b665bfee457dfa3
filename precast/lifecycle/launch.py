"""Loading exported kernels and turning user streams into raw CUDA stream handles."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Optional, Tuple

_RUNTIME_LIB = "libcute_dsl_runtime.so"
_runtime_loaded = False


def _runtime_candidates():
    if os.environ.get("PRECAST_CUTE_RUNTIME"):
        yield Path(os.environ["PRECAST_CUTE_RUNTIME"])
    try:  # the compiler's own copy, where the DSL is installed
        import importlib.util
        spec = importlib.util.find_spec("cutlass")
        if spec and spec.origin:
            root = Path(spec.origin).resolve().parents[2]
            for sub in ("cu13", "cu12"):
                yield root / sub / "lib" / _RUNTIME_LIB
    except (ImportError, ValueError):
        pass
    for entry in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if entry:
            yield Path(entry) / _RUNTIME_LIB


def ensure_runtime_loaded() -> None:
    """Exported kernels link against the CuTe DSL runtime library; make it resolvable.

    Loaded RTLD_GLOBAL so that dlopen of each kernel library finds it whatever the rpath.
    """
    global _runtime_loaded
    if _runtime_loaded:
        return
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi globally)
    errors = []
    for path in _runtime_candidates():
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                _runtime_loaded = True
                return
            except OSError as exc:
                errors.append(f"{path}: {exc}")
    try:
        ctypes.CDLL(_RUNTIME_LIB, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True
    except OSError as exc:
        raise RuntimeError(
            f"cannot load {_RUNTIME_LIB}, which precompiled kernels need: install "
            "nvidia-cutlass-dsl[cu13], or put the library on LD_LIBRARY_PATH or name it in "
            f"PRECAST_CUTE_RUNTIME ({'; '.join(errors) or exc})") from exc


def load_kernel(path: Path, symbol: str):
    """Returns the callable exported as ``symbol`` by the shared library at ``path``."""
    ensure_runtime_loaded()
    import tvm_ffi
    module = tvm_ffi.load_module(str(path))
    return module[symbol]


def stream_handle(stream: Any = None, device_index: Optional[int] = None) -> int:
    """A raw ``CUstream`` handle (int) from None (the current torch stream of the device), a
    ``torch.cuda.Stream``, a cuda-python ``CUstream``, a ``cuda.core`` stream or an int."""
    if stream is None:
        import torch
        return torch.cuda.current_stream(device_index).cuda_stream
    if isinstance(stream, int):
        return stream
    cuda_stream = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream / ExternalStream
    if isinstance(cuda_stream, int):
        return cuda_stream
    protocol = getattr(stream, "__cuda_stream__", None)  # cuda.core and other libraries
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        return int(value[1])
    handle = getattr(stream, "handle", None)
    if handle is not None and handle is not stream:
        return stream_handle(handle)
    try:  # cuda.bindings.driver.CUstream and other int-convertible handles
        return int(stream)
    except (TypeError, ValueError):
        pass
    raise TypeError(
        f"unsupported stream {type(stream).__name__}: pass None (current torch stream), a "
        "torch.cuda.Stream, a cuda.bindings.driver.CUstream, a cuda.core Stream or an int handle")


def torch_stream(handle: int, device_index: int):
    """The torch stream object for raw stream ``handle``, so torch work (memsets, copies,
    allocations) made current with ``torch.cuda.stream(...)`` is ordered with our launches
    on that handle. Not ``torch.cuda.ExternalStream(0)`` for the null stream: on the H200
    (torch 2.x) a copy made under it raced with a kernel just launched on handle 0, so the
    null handle maps to torch's own default stream (or the current one, when it is it)."""
    import torch
    current = torch.cuda.current_stream(device_index)
    if current.cuda_stream == handle:
        return current
    if handle == 0:
        return torch.cuda.default_stream(device_index)
    return torch.cuda.ExternalStream(handle, device=device_index)


def in_stream_order(stream, device):
    """Makes ``stream`` (None: the current one, or any kind stream_handle takes) current on
    ``device``, so that torch work inside (copies, allocations) is ordered with launches on
    it; a no-op for the current stream and for tensors without streams (meta, cpu)."""
    import contextlib

    import torch
    if stream is None or device.type != "cuda":
        return contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        stream = torch_stream(stream_handle(stream, device.index), device.index)
    return torch.cuda.stream(stream)


def device_guard(device_index: Optional[int]):
    """Makes the tensors' device current for a launch (a no-op when it already is)."""
    import contextlib

    import torch
    if device_index is None or device_index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device_index)


def stream_is_capturing(handle: int) -> bool:
    """Whether the stream (raw handle) is capturing a CUDA graph (a host-side query)."""
    from cuda.bindings import driver
    err, status = driver.cuStreamIsCapturing(driver.CUstream(handle))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamIsCapturing failed: {err}")
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


class SideStream:
    """A second stream beside a caller's stream on one device, for kernels of one call that
    do not depend on each other: fork(handle) orders it after the work so far on the
    caller's stream and returns its handle; join(handle) orders the caller's stream after
    the work launched on it since. Neither waits on the host; under CUDA graph capture the
    pair records a fork and a join in the graph."""

    def __init__(self, device_index: int):
        import torch
        self.device_index = device_index
        with device_guard(device_index):
            self.stream = torch.cuda.Stream(device=device_index)
            self.forked, self.done = torch.cuda.Event(), torch.cuda.Event()

    def fork(self, handle: int) -> int:
        self.forked.record(torch_stream(handle, self.device_index))
        self.stream.wait_event(self.forked)
        return self.stream.cuda_stream

    def join(self, handle: int) -> None:
        self.done.record(self.stream)
        torch_stream(handle, self.device_index).wait_event(self.done)


_side_streams: dict = {}


def side_stream(device_index: int, handle: int) -> SideStream:
    """The SideStream beside raw stream ``handle`` on a device (made on first use, then
    kept: one per caller stream, so calls on different streams stay independent)."""
    side = _side_streams.get((device_index, handle))
    if side is None:
        side = _side_streams[(device_index, handle)] = SideStream(device_index)
    return side


_sm_counts: dict = {}


def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a device (cached: persistent kernels size their grid)."""
    count = _sm_counts.get(device_index)
    if count is None:
        import torch
        count = _sm_counts[device_index] = torch.cuda.get_device_properties(
            device_index).multi_processor_count
    return count


def stream_workspace(cache: dict, outgrown: list, key, rows: Optional[int], make,
                     capturing, refusal):
    """An op's own workspace for ``key`` = (device index, stream handle), so that execute()
    allocates only the first time on a stream (or when the batch outgrew it) and never
    while that stream captures a CUDA graph.

    ``make(n)`` allocates it (a tensor, or a tuple of tensors, of n leading rows; n is None
    for a fixed size, ``rows`` None) on the stream. With ``rows`` given it is remade, at
    max(rows, twice as many), when it has fewer; the outgrown one stays in ``outgrown``
    (a graph captured with it may still run). ``capturing()`` is asked only when something
    must be made; then ``RuntimeError(refusal())``."""
    ws = cache.get(key)
    have = None if ws is None else (ws[0] if isinstance(ws, tuple) else ws).shape[0]
    if ws is None or (rows is not None and have < rows):
        if capturing():
            raise RuntimeError(refusal())
        if ws is not None:
            outgrown.append(ws)
        ws = make(rows if ws is None or rows is None else max(rows, 2 * have))
        cache[key] = ws
    return ws


# A persistent kernel's claim counter: int32 (next work item, CTAs finished), zero before a
# launch and left zero by it (its last CTA resets it), so one buffer serves every launch on
# one stream; launches that may overlap (other streams) need their own.
SCHEDULER_COUNTER_SHAPE = (2,)


def own_scheduler_counter(cache: dict, device_index: int, handle: int, owner: str,
                          shape: Tuple[int, ...] = SCHEDULER_COUNTER_SHAPE):
    """An op's own scheduler counter for (device, stream) in ``cache``, zeroed on the stream
    the first time (stream_workspace: never made while the stream captures a graph).
    ``shape``: the counter's words and whatever the op keeps after them.

    One exception: while torch itself captures this stream (torch.cuda.graph, and so
    torch.compile's CUDA graphs, which capture on a stream of their own), a stream with no
    counter yet gets a fresh one from torch's graph memory pool, not kept: the graph owns
    it, and its memset node zeroes it before every replay."""
    import torch

    if (device_index, handle) not in cache and _torch_captures(device_index, handle):
        return torch.zeros(shape, dtype=torch.int32, device=f"cuda:{device_index}")

    def make(_):
        with torch.cuda.stream(torch_stream(handle, device_index)):
            return torch.zeros(shape, dtype=torch.int32, device=f"cuda:{device_index}")
    return stream_workspace(
        cache, [], (device_index, handle), None, make, lambda: stream_is_capturing(handle),
        lambda: f"{owner}.execute: the stream is capturing a CUDA graph and this op has no "
                f"workspace for it yet; pass workspace= (int32, shape {shape}, zeroed) or "
                "execute once on this stream before capturing")


def _torch_captures(device_index: int, handle: int) -> bool:
    """Whether torch is capturing a CUDA graph on raw stream ``handle`` (its current stream)."""
    import torch
    if not torch.cuda.is_available():
        return False
    with device_guard(device_index):
        return (torch.cuda.is_current_stream_capturing()
                and torch.cuda.current_stream().cuda_stream == handle)
