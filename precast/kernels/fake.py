"""Fake (shape-only) arguments for compiling kernels without tensors or a GPU.

Row counts are symbolic, row strides symbolic multiples of 8 elements (16 bytes for
16-bit types), bases 16-byte aligned: one compile serves every N and padded stride.
"""
import cutlass
import cutlass.cute as cute

ROW_STRIDE_DIVISIBILITY = 8


def cute_dtype(name: str):
    """The CuTe DSL numeric type of a dtype name ('bfloat16', 'float16', ...)."""
    table = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
             "int8": cutlass.Int8, "int32": cutlass.Int32}
    return table[name]


def rows_symbol():
    return cute.sym_int()


def fake_rows(dtype, rows, cols: int, packed: bool = False):
    # 64-bit row strides: y and dy (up to 3 * 2^31 elements) need 64-bit offsets.
    stride = cols if packed else cute.sym_int(width=64, divisibility=ROW_STRIDE_DIVISIBILITY)
    return cute.runtime.make_fake_tensor(dtype, (rows, cols), (stride, 1), assumed_align=16)


def fake_tokens(dtype, tokens, heads: int, head_dim: int):
    """(T, H, D) with the last dimension contiguous and runtime token (64-bit) and head
    strides: strided views of a fused projection compile into the same kernel."""
    strides = (cute.sym_int(width=64, divisibility=ROW_STRIDE_DIVISIBILITY),
               cute.sym_int(divisibility=ROW_STRIDE_DIVISIBILITY), 1)
    return cute.runtime.make_fake_tensor(dtype, (tokens, heads, head_dim), strides,
                                         assumed_align=16)


def fake_packed(dtype, shape, align: int):
    """A contiguous row-major tensor (the default order of compact fakes is column-major)."""
    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)


def fake_vector(dtype, length, align: int = 16):
    return cute.runtime.make_fake_compact_tensor(dtype, (length,), assumed_align=align)


def fake_workspace(slots: int, cols: int):
    return cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), slots, cols),
                                         (slots * cols, cols, 1), assumed_align=16)


def fake_stream():
    # An explicit stream argument: execute() passes any user stream as a raw handle.
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)


def scalar(kind, value):
    return kind(value)
