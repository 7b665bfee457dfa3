"""Elementwise activations shared by the forward and backward kernels."""
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def tanh_approx(x: Float32) -> Float32:
    """tanh.approx.f32: one MUFU.TANH."""
    return cute.arch.inline_ptx("tanh.approx.f32 {$w0}, {$r0};", write_only_types=[Float32],
                                read_only_args=[x])


@cute.jit
def fast_sigmoid(u: Float32) -> Float32:
    # sigmoid(u) = 0.5 + 0.5 * tanh(u / 2): one MUFU.TANH instead of EX2 + RCP.
    return Float32(0.5) + Float32(0.5) * tanh_approx(u * Float32(0.5))
