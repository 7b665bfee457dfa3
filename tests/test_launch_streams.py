"""launch.torch_stream: which torch stream object torch-side work (memsets, copies,
allocations) is made current on, so that it is ordered with a kernel launched on a raw handle.
Runs on a CPU machine: torch.cuda's stream functions are stood in for."""
import types

import pytest
import torch

from precast.lifecycle import launch


class FakeStream:
    def __init__(self, handle, kind, device=None):
        self.cuda_stream, self.kind, self.device = handle, kind, device


@pytest.fixture
def streams(monkeypatch):
    state = types.SimpleNamespace(current=FakeStream(0, "default"), asked=[])

    def current_stream(index=None):
        state.asked.append(index)
        return state.current
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda index=None: FakeStream(0, "default"))
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda handle, device=None: FakeStream(handle, "external", device))
    return state


def test_the_current_stream_when_it_is_the_handle(streams):
    streams.current = FakeStream(1234, "side")
    assert launch.torch_stream(1234, 3) is streams.current
    assert streams.asked == [3]


def test_the_null_handle_is_torchs_default_stream_not_an_external_one(streams):
    """torch.cuda.ExternalStream(0) was not ordered with a launch on handle 0 (H200)."""
    streams.current = FakeStream(777, "side")
    got = launch.torch_stream(0, 0)
    assert got.kind == "default" and got.cuda_stream == 0
    streams.current = FakeStream(0, "default")
    assert launch.torch_stream(0, 0) is streams.current


def test_other_handles_are_wrapped_on_the_right_device(streams):
    got = launch.torch_stream(0xBEEF, 2)
    assert (got.kind, got.cuda_stream, got.device) == ("external", 0xBEEF, 2)
