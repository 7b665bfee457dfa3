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


# --- launch.stream_workspace: an op's own workspace per (device, stream) ---------------------------
class Maker:
    def __init__(self):
        self.made = []

    def __call__(self, rows):
        self.made.append(rows)
        return torch.zeros(rows if rows is not None else 3)


def test_workspace_made_once_per_stream_then_reused():
    cache, outgrown, make = {}, [], Maker()
    asked = []
    get = lambda key, rows: launch.stream_workspace(cache, outgrown, key, rows, make,
                                                    lambda: asked.append(key) or False,
                                                    lambda: "never")
    first = get((0, 7), 10)
    assert get((0, 7), 10) is first and get((0, 7), 4) is first  # no capture query either
    other = get((0, 8), 10)
    assert other is not first and make.made == [10, 10] and asked == [(0, 7), (0, 8)]
    assert outgrown == [] and set(cache) == {(0, 7), (0, 8)}


def test_workspace_grows_to_at_least_twice_and_keeps_the_old_one():
    cache, outgrown, make = {}, [], Maker()
    get = lambda rows: launch.stream_workspace(cache, outgrown, (1, 5), rows, make,
                                               lambda: False, lambda: "never")
    small = get(10)
    assert get(11).shape[0] == 20 and outgrown == [small]  # doubled
    big = get(100)
    assert big.shape[0] == 100 and len(outgrown) == 2 and make.made == [10, 20, 100]
    pair_cache = {}
    pair = launch.stream_workspace(pair_cache, [], (0, 0), 4, lambda n: (torch.zeros(n),
                                   torch.zeros(1)), lambda: False, lambda: "never")
    assert launch.stream_workspace(pair_cache, [], (0, 0), 4, None, lambda: False,
                                   lambda: "never") is pair  # a tuple's rows are its first's


def test_fixed_size_workspace_is_never_remade():
    cache, make = {}, Maker()
    ws = launch.stream_workspace(cache, [], (0, 1), None, make, lambda: False, lambda: "no")
    assert launch.stream_workspace(cache, [], (0, 1), None, make, lambda: True,
                                   lambda: "no") is ws and make.made == [None]


def test_workspace_refused_while_capturing_with_the_message_made_only_then():
    cache, outgrown, make = {}, [], Maker()
    messages = []

    def refusal():
        messages.append(1)
        return "capturing: pass workspace="
    with pytest.raises(RuntimeError, match="^capturing: pass workspace=$"):
        launch.stream_workspace(cache, outgrown, (0, 7), 10, make, lambda: True, refusal)
    assert cache == {} and make.made == [] and messages == [1]
    launch.stream_workspace(cache, outgrown, (0, 7), 10, make, lambda: False, refusal)
    with pytest.raises(RuntimeError):  # growing is refused too
        launch.stream_workspace(cache, outgrown, (0, 7), 11, make, lambda: True, refusal)
    assert cache[(0, 7)].shape[0] == 10 and outgrown == [] and messages == [1, 1]
