"""TensorDesc: the frozen, hashable tensor descriptions ops are compiled for (CPU only)."""
import dataclasses

import pytest
import torch

from precast import TensorDesc
from precast.lifecycle.tensor_desc import dtype_name, parse_dtype


# --- construction --------------------------------------------------------------------------
def test_defaults_are_contiguous_aligned_cuda():
    d = TensorDesc(torch.bfloat16, (1024, 512))
    assert d.stride == (512, 1)
    assert d.device == "cuda"
    assert d.alignment == 16
    assert d.ndim == 2
    assert d.numel == 1024 * 512
    assert d.itemsize == 2
    assert d.is_contiguous()


def test_shape_and_stride_are_normalised_to_int_tuples():
    d = TensorDesc("bf16", [4, 8], [16, 1])
    assert d.shape == (4, 8) and isinstance(d.shape, tuple)
    assert d.stride == (16, 1) and isinstance(d.stride, tuple)
    assert d.dtype is torch.bfloat16
    assert all(type(v) is int for v in d.shape + d.stride)


@pytest.mark.parametrize("shape,stride", [
    ((2, 3, 4), (12, 4, 1)),
    ((5,), (1,)),
    ((), ()),
    ((0, 8), (8, 1)),   # zero extents still give the canonical packed strides
    ((3, 0, 2), (2, 2, 1)),
])
def test_default_strides_are_row_major(shape, stride):
    assert TensorDesc(torch.float32, shape).stride == stride


def test_itemsize_per_dtype():
    assert TensorDesc(torch.float32, (2,)).itemsize == 4
    assert TensorDesc(torch.int8, (2,)).itemsize == 1
    assert TensorDesc(torch.float64, (2,)).itemsize == 8


# --- from_tensor -----------------------------------------------------------------------------
def test_from_tensor_cpu_contiguous():
    t = torch.zeros(6, 10, dtype=torch.float16)
    d = TensorDesc.from_tensor(t)
    assert d.dtype is torch.float16
    assert d.shape == (6, 10)
    assert d.stride == (10, 1)
    assert d.device == "cpu"
    ptr = t.data_ptr()
    assert d.alignment == min(ptr & -ptr, 256)
    assert d.alignment >= 16  # CPU allocations are at least 16-byte aligned


def test_from_tensor_view_offset_by_one_bf16_element_is_2_byte_aligned():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert base.data_ptr() % 4 == 0
    view = base[1:]
    d = TensorDesc.from_tensor(view)
    assert d.alignment == 2
    assert d.shape == (63,)
    # offset by 8 elements (16 bytes) from a >= 32-byte aligned base: exactly 16
    if base.data_ptr() % 32 == 0:
        assert TensorDesc.from_tensor(base[8:]).alignment == 16


def test_from_tensor_alignment_is_capped_at_256():
    t = torch.zeros(4096, dtype=torch.uint8)
    aligned = t[(-t.data_ptr()) % 512:]  # a view starting on a 512-byte boundary
    assert aligned.data_ptr() % 512 == 0
    assert TensorDesc.from_tensor(aligned).alignment == 256


def test_from_tensor_strided_view():
    t = torch.zeros(8, 16, dtype=torch.float32)
    v = t[:, :8]
    d = TensorDesc.from_tensor(v)
    assert d.shape == (8, 8) and d.stride == (16, 1)
    assert not d.is_contiguous()
    tt = TensorDesc.from_tensor(t.t())
    assert tt.shape == (16, 8) and tt.stride == (1, 16)


def test_from_tensor_meta_is_16_byte_aligned():
    d = TensorDesc.from_tensor(torch.empty(4, 8, dtype=torch.bfloat16, device="meta"))
    assert d.device == "meta"
    assert d.alignment == 16
    assert d.stride == (8, 1)


def test_from_tensor_passes_descs_through_and_rejects_other_types():
    d = TensorDesc(torch.bfloat16, (4, 8))
    assert TensorDesc.from_tensor(d) is d
    with pytest.raises(TypeError, match="expected a torch.Tensor or TensorDesc, got list"):
        TensorDesc.from_tensor([1, 2, 3])


# --- frozen / hashable ------------------------------------------------------------------------
def test_frozen():
    d = TensorDesc(torch.bfloat16, (4, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.shape = (8, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.alignment = 4
    assert d.shape == (4, 8) and d.alignment == 16


def test_equality_and_hash():
    a = TensorDesc(torch.bfloat16, (4, 8))
    b = TensorDesc("bfloat16", [4, 8], (8, 1), "cuda", 16)
    c = TensorDesc("bf16", (4, 8))
    assert a == b == c
    assert hash(a) == hash(b) == hash(c)
    assert len({a, b, c}) == 1
    assert a != TensorDesc(torch.float16, (4, 8))
    assert a != TensorDesc(torch.bfloat16, (4, 8), (16, 1))
    assert a != TensorDesc(torch.bfloat16, (4, 8), alignment=8)
    assert a != TensorDesc(torch.bfloat16, (4, 8), device="meta")
    assert {a: 1}[TensorDesc(torch.bfloat16, (4, 8))] == 1


def test_from_tensor_equals_hand_built():
    t = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    assert TensorDesc.from_tensor(t) == TensorDesc(torch.bfloat16, (4, 8), device="meta")


# --- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape,stride", [((-1, 8), None), ((4, 8), (8, -1))])
def test_negative_extent_or_stride(shape, stride):
    with pytest.raises(ValueError, match="negative extent or stride"):
        TensorDesc(torch.bfloat16, shape, stride)


@pytest.mark.parametrize("stride", [(1,), (32, 8, 1)])
def test_stride_rank_mismatch(stride):
    with pytest.raises(ValueError, match="does not match shape"):
        TensorDesc(torch.bfloat16, (4, 8), stride)


@pytest.mark.parametrize("alignment", [0, -16, 3, 12, 24])
def test_alignment_must_be_power_of_two(alignment):
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        TensorDesc(torch.bfloat16, (4, 8), alignment=alignment)


@pytest.mark.parametrize("alignment", [1, 2, 4, 256])
def test_power_of_two_alignments_accepted(alignment):
    assert TensorDesc(torch.bfloat16, (4, 8), alignment=alignment).alignment == alignment


def test_unknown_dtype_in_constructor():
    with pytest.raises(TypeError, match="unknown dtype 'bf17'"):
        TensorDesc("bf17", (4,))


# --- parse_dtype ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,dtype", [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("fp16", torch.float16), ("half", torch.float16), ("float16", torch.float16),
    ("fp32", torch.float32), ("float", torch.float32), ("float32", torch.float32),
    ("int8", torch.int8), ("bool", torch.bool), (torch.int64, torch.int64),
])
def test_parse_dtype_aliases(text, dtype):
    assert parse_dtype(text) is dtype


@pytest.mark.parametrize("bad", ["fp8", "complex64", "", None, 16])
def test_parse_dtype_error_lists_known(bad):
    with pytest.raises(TypeError, match=r"unknown dtype .*expected one of \[.*'bfloat16'"):
        parse_dtype(bad)


def test_dtype_name_roundtrip():
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        assert parse_dtype(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"


# --- span / contiguity ---------------------------------------------------------------------
def test_span_elements():
    assert TensorDesc(torch.bfloat16, (4, 8)).span_elements() == 32
    assert TensorDesc(torch.bfloat16, (4, 8), (16, 1)).span_elements() == 3 * 16 + 8
    assert TensorDesc(torch.bfloat16, (0, 8)).span_elements() == 0
    assert TensorDesc(torch.bfloat16, (8, 0)).span_elements() == 0
    assert TensorDesc(torch.bfloat16, ()).span_elements() == 1
    assert TensorDesc(torch.bfloat16, (5,), (3,)).span_elements() == 13


def test_span_matches_torch_storage_extent():
    base = torch.zeros(40, 24, dtype=torch.float16)
    view = base[2:30:3, 4:20]
    d = TensorDesc.from_tensor(view)
    last = view[-1, -1].data_ptr()
    assert d.span_elements() == (last - view.data_ptr()) // 2 + 1


def test_is_contiguous():
    assert TensorDesc(torch.bfloat16, (4, 8)).is_contiguous()
    assert not TensorDesc(torch.bfloat16, (4, 8), (16, 1)).is_contiguous()
    assert not TensorDesc(torch.bfloat16, (4, 8), (1, 4)).is_contiguous()
    # extents of 1 ignore their stride, like torch
    assert TensorDesc(torch.bfloat16, (1, 8), (999, 1)).is_contiguous()
    assert TensorDesc(torch.bfloat16, (4, 1), (1, 7)).is_contiguous()
    assert TensorDesc.from_tensor(torch.zeros(3, 5)).is_contiguous()
    assert not TensorDesc.from_tensor(torch.zeros(3, 5).t()).is_contiguous()


def test_describe_mentions_everything():
    text = TensorDesc(torch.bfloat16, (4, 8), (16, 1), alignment=8).describe()
    assert "bfloat16" in text and "[4, 8]" in text and "[16, 1]" in text
    assert "cuda" in text and "8-byte" in text


def test_optional_passes_none_through():
    t = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    assert TensorDesc.optional(None) is None
    assert TensorDesc.optional(t) == TensorDesc.from_tensor(t)
    d = TensorDesc(torch.float32, (3,))
    assert TensorDesc.optional(d) is d
