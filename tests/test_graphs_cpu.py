"""The parts of precast.graphs and precast.lifecycle.launch that need no GPU."""
import pytest
from cuda.bindings import driver

import precast.graphs as graphs
from precast.lifecycle.launch import stream_handle


class CudaStreamProtocol:
    def __cuda_stream__(self):
        return (0, 77)


class CudaStreamProtocolAttribute:
    __cuda_stream__ = (0, 88)  # a plain attribute works too


class TorchLikeStream:
    cuda_stream = 4242


class HandleWrapper:
    def __init__(self, handle):
        self.handle = handle


def test_stream_handle_int():
    assert stream_handle(1234) == 1234
    assert stream_handle(0) == 0  # the legacy default stream


def test_stream_handle_cuda_python_custream():
    s = driver.CUstream(1234)
    assert stream_handle(s) == 1234
    assert type(stream_handle(s)) is int
    assert stream_handle(driver.CUstream(0)) == 0


def test_stream_handle_cuda_stream_protocol():
    assert stream_handle(CudaStreamProtocol()) == 77
    assert stream_handle(CudaStreamProtocolAttribute()) == 88


def test_stream_handle_torch_like_and_handle_attribute():
    assert stream_handle(TorchLikeStream()) == 4242
    assert stream_handle(HandleWrapper(driver.CUstream(55))) == 55
    assert stream_handle(HandleWrapper(HandleWrapper(9))) == 9


@pytest.mark.parametrize("bad", [object(), "not-a-stream", [1], HandleWrapper(object())])
def test_stream_handle_rejects_unsupported(bad):
    with pytest.raises(TypeError, match="unsupported stream .*: pass None"):
        stream_handle(bad)


def test_check_success_unwraps_values():
    ok = driver.CUresult.CUDA_SUCCESS
    assert graphs.check((ok,)) is None
    assert graphs.check(ok) is None
    assert graphs.check((ok, 5)) == 5
    assert graphs.check((ok, 1, 2)) == (1, 2)


@pytest.mark.parametrize("err", [driver.CUresult.CUDA_ERROR_INVALID_VALUE,
                                 driver.CUresult.CUDA_ERROR_NOT_INITIALIZED,
                                 driver.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED])
def test_check_raises_for_errors(err):
    with pytest.raises(RuntimeError, match=f"CUDA driver error {err.name}"):
        graphs.check((err,))
    with pytest.raises(RuntimeError, match=err.name):
        graphs.check((err, 123))  # values are never returned alongside an error


def test_check_uses_driver_error_name_when_available(monkeypatch):
    class FakeDriver:
        CUresult = driver.CUresult

        @staticmethod
        def cuGetErrorName(err):
            return driver.CUresult.CUDA_SUCCESS, b"CUDA_ERROR_FROM_DRIVER"
    monkeypatch.setattr(graphs, "_driver", lambda: FakeDriver)
    with pytest.raises(RuntimeError, match="CUDA driver error CUDA_ERROR_FROM_DRIVER"):
        graphs.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,))


def _bare_graph(**state):
    """A CudaGraph without the constructor (which needs a driver): only host-side logic."""
    g = graphs.CudaGraph.__new__(graphs.CudaGraph)
    g._graph, g._exec, g._owns_stream, g.stream, g._handle = None, None, False, None, 0
    for name, value in state.items():
        setattr(g, name, value)
    return g


def test_graph_state_before_capture():
    g = _bare_graph()
    assert not g.is_captured
    assert g.num_nodes() == 0
    with pytest.raises(RuntimeError, match="nothing captured yet"):
        g.replay()
    g.close()  # nothing to release
    assert g._exec is None and g._graph is None


def test_graph_refuses_second_capture():
    g = _bare_graph(_exec=object())
    assert g.is_captured
    with pytest.raises(RuntimeError, match="already holds a capture; make a new one"):
        with g.capture():
            pass
