"""Capture a sequence of execute() calls into a CUDA graph through cuda-python, and replay it.

    graph = CudaGraph()
    with graph.capture() as stream:
        fwd.execute(..., stream=stream)
        bwd.execute(..., stream=stream)
    graph.replay()           # on the graph's own stream, or replay(stream=...)
    graph.synchronize()

Kernels read their inputs from device memory at replay time, so updating inputs in place
between replays changes the results; shapes and pointers are frozen at capture.
"""
from __future__ import annotations

import contextlib
from ..lifecycle.launch import stream_handle


def _driver():
    from cuda.bindings import driver
    return driver


def check(result):
    """Unwraps a cuda-python (error, *values) tuple, raising on any error."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        try:
            _, name = driver.cuGetErrorName(err)
            name = name.decode() if name else None
        except Exception:  # no usable driver library: fall back to the enum's own name
            name = None
        raise RuntimeError(f"CUDA driver error {name or getattr(err, 'name', err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def ensure_context(device: int = 0) -> None:
    """Makes the device's primary context current (torch shares it) if none is."""
    driver = _driver()
    check(driver.cuInit(0))
    ctx = check(driver.cuCtxGetCurrent())
    if ctx is None or int(ctx) == 0:
        dev = check(driver.cuDeviceGet(device))
        check(driver.cuCtxSetCurrent(check(driver.cuDevicePrimaryCtxRetain(dev))))


class CudaGraph:
    def __init__(self, stream=None, device: int = 0):
        driver = _driver()
        ensure_context(device)
        self._owns_stream = stream is None
        if stream is None:
            stream = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.stream = stream
        self._handle = stream_handle(stream)
        self._graph = None
        self._exec = None

    @property
    def is_captured(self) -> bool:
        return self._exec is not None

    @contextlib.contextmanager
    def capture(self):
        """Records every launch made on the yielded stream until the block ends."""
        driver = _driver()
        if self._exec is not None:
            raise RuntimeError("this CudaGraph already holds a capture; make a new one")
        stream = driver.CUstream(self._handle)
        check(driver.cuStreamBeginCapture(
            stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            yield self.stream
        except BaseException:
            with contextlib.suppress(Exception):
                graph = check(driver.cuStreamEndCapture(stream))
                if graph is not None:
                    driver.cuGraphDestroy(graph)
            raise
        self._graph = check(driver.cuStreamEndCapture(stream))
        self._exec = check(driver.cuGraphInstantiate(self._graph, 0))

    def num_nodes(self) -> int:
        driver = _driver()
        if self._graph is None:
            return 0
        _, count = check(driver.cuGraphGetNodes(self._graph, 0))
        return int(count)

    def replay(self, stream=None) -> None:
        driver = _driver()
        if self._exec is None:
            raise RuntimeError("nothing captured yet: use 'with graph.capture() as s:' first")
        target = self._handle if stream is None else stream_handle(stream)
        check(driver.cuGraphLaunch(self._exec, driver.CUstream(target)))

    def synchronize(self) -> None:
        driver = _driver()
        check(driver.cuStreamSynchronize(driver.CUstream(self._handle)))

    def close(self) -> None:
        driver = _driver()
        if self._exec is not None:
            check(driver.cuGraphExecDestroy(self._exec))
            self._exec = None
        if self._graph is not None:
            check(driver.cuGraphDestroy(self._graph))
            self._graph = None
        if self._owns_stream and self.stream is not None:
            check(driver.cuStreamDestroy(driver.CUstream(self._handle)))
            self.stream = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
