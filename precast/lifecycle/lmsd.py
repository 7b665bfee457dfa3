"""HSTU LayerNorm-Multiply-SiLU-Dropout (LMSD) ops for SM90: HstuLmsdFwdSm90, HstuLmsdBwdSm90."""
from __future__ import annotations

import functools
from typing import Dict, Mapping, Optional, Tuple

import numpy as np
import torch

from ..reference.lmsd import segment_count
from ..reference.philox import keep_threshold
from .cache import KernelBuilder
from .launch import (SCHEDULER_COUNTER_SHAPE, device_guard, own_scheduler_counter, sm_count,
                     stream_handle)
from .op import Op
from .tensor_desc import TensorDesc, dtype_name, parse_dtype
from .validation import (check_bool, check_finite, check_int64, check_no_overlap,
                         check_same_device, check_tensor, check_value)

LMSD_DTYPES = (torch.bfloat16, torch.float16)
LMSD_MIN_DIM, LMSD_MAX_DIM, LMSD_DIM_MULTIPLE = 8, 4096, 8
ROW_MULTIPLE = 8  # elements of a 16-bit dtype per 16-byte row alignment
ROW_SPAN_LIMIT = 2**62  # row tensors are compiled with 64-bit row strides
MAX_ROW_ELEMENTS = 2**31  # N * D: the packed mask and per-row indices stay 32-bit
VECS_PER_THREAD = (1, 2, 4)  # 16-byte vectors each thread owns per row (tuning knob)
DEFAULT_VECS_PER_THREAD = {"fwd": 2, "bwd": 2}
MAX_MIN_CTAS_PER_SM = 16
# bwd: a register cap; 0 = none (bench/RESULTS.md). fwd: its persistent grid's CTAs per SM
# (the launch bounds make them fit); 0 = FWD_THREADS_PER_SM threads' worth.
DEFAULT_MIN_CTAS_PER_SM = {"fwd": 0, "bwd": 3}
FWD_THREADS_PER_SM = 512
MAX_THREADS_PER_SM = 2048
BWD_CTAS_PER_SM = 2  # persistent backward grid (fits the kernel's register use)
_SM90_SOURCES = ("precast.kernels.rowwise", "precast.kernels.tiling", "precast.kernels.philox",
                 "precast.kernels.activation", "precast.kernels.fake")


def check_dropout_ratio(dropout_ratio) -> float:
    p = check_finite("dropout_ratio", dropout_ratio, lo=0.0)
    check_value(np.float32(p) < 1.0, ValueError,
                f"dropout_ratio must be < 1 after float32 conversion, got {dropout_ratio}")
    return p


@functools.lru_cache(maxsize=64)
def dropout_scalars(p: float) -> Tuple[int, float]:
    """(keep threshold on the uint32 Philox word, scale of kept values)."""
    return keep_threshold(p), 1.0 / (1.0 - p)


def check_dim(dim: int) -> None:
    if dim % LMSD_DIM_MULTIPLE:
        raise ValueError(f"D = {dim} must be a multiple of {LMSD_DIM_MULTIPLE}")
    if dim < LMSD_MIN_DIM:
        raise ValueError(f"D = {dim} must be at least {LMSD_MIN_DIM}")
    if dim > LMSD_MAX_DIM:
        raise NotImplementedError(f"D = {dim} is above the supported maximum {LMSD_MAX_DIM}")


class _LmsdBase(Op):
    supported_archs = ("sm_90a",)

    def _init_common(self, dtype, dim, dropout_ratio, apply_u_silu, concat_u, concat_x,
                     vecs_per_thread, min_ctas_per_sm, direction):
        self.vecs_per_thread = (DEFAULT_VECS_PER_THREAD[direction] if vecs_per_thread is None
                                else vecs_per_thread)
        self.min_ctas_per_sm = (DEFAULT_MIN_CTAS_PER_SM[direction] if min_ctas_per_sm is None
                                else min_ctas_per_sm)
        self.dtype = dtype
        self.dim = dim
        self.dropout_ratio = dropout_ratio
        self.apply_u_silu = apply_u_silu
        self.concat_u = concat_u
        self.concat_x = concat_x

    @property
    def segments(self) -> int:
        return segment_count(self.concat_u, self.concat_x)

    @property
    def use_dropout(self) -> bool:
        return float(self.dropout_ratio) != 0.0

    def _check_common(self) -> float:
        for name in ("apply_u_silu", "concat_u", "concat_x"):
            check_bool(name, getattr(self, name))
        if self.dtype not in LMSD_DTYPES:
            raise TypeError(f"x: dtype {dtype_name(self.dtype)} is not supported; expected "
                            "bfloat16 or float16")
        check_dim(self.dim)
        if self.vecs_per_thread not in VECS_PER_THREAD:
            raise ValueError(f"vecs_per_thread must be one of {VECS_PER_THREAD}, got "
                             f"{self.vecs_per_thread}")
        if (not isinstance(self.min_ctas_per_sm, int)
                or not 0 <= self.min_ctas_per_sm <= MAX_MIN_CTAS_PER_SM):
            raise ValueError(f"min_ctas_per_sm must be an int in [0, {MAX_MIN_CTAS_PER_SM}], got "
                             f"{self.min_ctas_per_sm}")
        return check_dropout_ratio(self.dropout_ratio)

    @functools.cached_property
    def tiling(self):
        from ..kernels.tiling import RowTiling
        return RowTiling(self.dim, vecs_per_thread_target=self.vecs_per_thread)

    def _rows(self, name, t, cols, *, contiguous=False, dtypes=None):
        shape = check_tensor(name, t, dtypes=dtypes or (self.dtype,), shape=(None, cols),
                             row_multiple=ROW_MULTIPLE, contiguous=contiguous,
                             max_span=ROW_SPAN_LIMIT)
        if name == "x" and shape[0] * self.dim > MAX_ROW_ELEMENTS:
            raise ValueError(f"x: N * D = {shape[0]} * {self.dim} exceeds 2^31 elements")
        return shape

    def _vector(self, name, t, length, dtype=None, align=16):
        return check_tensor(name, t, dtypes=(dtype or self.dtype,), shape=(length,),
                            align=align, contiguous=True)

    def _mask(self, mask, num_rows: int):
        if self.use_dropout:
            check_value(mask is not None, ValueError,
                        "mask_tensor is required when dropout_ratio > 0")
            shape = check_tensor("mask", mask, dtypes=(torch.int8,), shape=(None, self.dim),
                                 contiguous=True)
            self._same_rows("mask", shape, num_rows)
        else:
            check_value(mask is None, ValueError,
                        "mask must be None when dropout_ratio == 0 (no dropout, no mask)")

    def _check_relations(self, named: Mapping[str, object]) -> None:
        """One device; outputs alias neither each other nor an input (host metadata only)."""
        check_same_device(list(named.items()))
        check_no_overlap([(k, named[k]) for k in self.OUTPUTS],
                         [(k, named[k]) for k in named if k not in self.OUTPUTS])

    def _runtime_dropout(self, dropout_ratio: Optional[float]) -> Tuple[int, float]:
        """(keep threshold, keep scale) for this call; dropout on/off is fixed at compile."""
        if not self.use_dropout:
            check_value(dropout_ratio in (None, 0, 0.0), ValueError,
                        "this op was compiled without dropout: dropout_ratio must be 0")
            return 0, 1.0
        p = check_dropout_ratio(self.dropout_ratio if dropout_ratio is None else dropout_ratio)
        check_value(p > 0.0, ValueError, "this op was compiled with dropout: dropout_ratio "
                    "must stay > 0 (build another op for dropout_ratio = 0)")
        return dropout_scalars(p)

    @staticmethod
    def _same_rows(name: str, shape, num_rows: int):
        if shape[0] != num_rows:
            raise ValueError(f"{name}: has {shape[0]} rows but x has {num_rows}")


class HstuLmsdFwdSm90(_LmsdBase):
    """y = [dropout(a)?, dropout(x)?, dropout(LN(x) * w + b) * a)], a = SiLU(u) or u.

    Construct from sample tensors or TensorDescs (row counts and padded row strides are
    runtime values: one compile serves every N), then check_support(), compile(),
    execute(). ``dropout_ratio`` only selects dropout on/off at compile time; its value,
    ``eps`` and ``seed`` may change per execute. Tuning knobs: ``vecs_per_thread`` (16-byte
    vectors per thread and row) and ``min_ctas_per_sm``, the persistent grid's CTAs per SM
    (0: FWD_THREADS_PER_SM threads' worth; the launch bounds cap registers to fit them).
    """

    kernel_sources = ("precast.kernels.lmsd_fwd_sm90", "precast.kernels.scheduler") + _SM90_SOURCES
    OUTPUTS = ("y", "mean", "rstd", "mask", "workspace")

    def __init__(self, sample_x, sample_u, sample_weight, sample_bias, sample_y=None,
                 sample_mean=None, sample_rstd=None, sample_mask=None, *, eps: float = 1e-5,
                 dropout_ratio: float = 0.0, apply_u_silu: bool = True, concat_u: bool = False,
                 concat_x: bool = False, vecs_per_thread: Optional[int] = None,
                 min_ctas_per_sm: Optional[int] = None):
        super().__init__()
        desc = TensorDesc.optional
        self.x, self.u = desc(sample_x), desc(sample_u)
        self.weight, self.bias = desc(sample_weight), desc(sample_bias)
        self._init_common(self.x.dtype, self.x.shape[-1] if self.x.ndim else 0, dropout_ratio,
                          apply_u_silu, concat_u, concat_x, vecs_per_thread, min_ctas_per_sm,
                          "fwd")
        n = self.x.shape[0] if self.x.ndim else 0
        seg = self.segments
        self.y = desc(sample_y) or TensorDesc(self.dtype, (n, seg * self.dim))
        self.mean = desc(sample_mean) or TensorDesc(torch.float32, (n,))
        self.rstd = desc(sample_rstd) or TensorDesc(torch.float32, (n,))
        self.mask = desc(sample_mask)
        if self.mask is None and self.use_dropout and sample_mask is None:
            self.mask = TensorDesc(torch.int8, (n, self.dim))
        self.eps = eps
        # Scheduler counters this op made, per (device, stream): see execute().
        self._workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
        self._samples = dict(x=sample_x, u=sample_u, weight=sample_weight, bias=sample_bias,
                             y=sample_y, mean=sample_mean, rstd=sample_rstd, mask=sample_mask,
                             workspace=None)

    def static_config(self) -> Dict[str, object]:
        return {"dtype": dtype_name(self.dtype), "dim": self.dim, "apply_u_silu": self.apply_u_silu,
                "concat_u": self.concat_u, "concat_x": self.concat_x,
                "dropout": self.use_dropout, "vecs_per_thread": self.vecs_per_thread,
                "min_ctas_per_sm": self.min_ctas_per_sm}

    @classmethod
    def from_config(cls, dtype="bfloat16", dim=512, apply_u_silu=True, concat_u=False,
                    concat_x=False, dropout=True, vecs_per_thread=None,
                    min_ctas_per_sm=None):
        dt = parse_dtype(dtype)
        rows = TensorDesc(dt, (1024, dim))
        vec = TensorDesc(dt, (dim,))
        return cls(rows, rows, vec, vec, dropout_ratio=0.5 if dropout else 0.0,
                   apply_u_silu=apply_u_silu, concat_u=concat_u, concat_x=concat_x,
                   vecs_per_thread=vecs_per_thread, min_ctas_per_sm=min_ctas_per_sm)

    def _check(self) -> None:
        self._check_common()
        check_finite("eps", self.eps, positive=True)
        threads = self.ctas_per_sm * self.tiling.num_threads
        if threads > MAX_THREADS_PER_SM:
            raise ValueError(
                f"min_ctas_per_sm = {self.min_ctas_per_sm} puts {threads} threads on an SM "
                f"({self.tiling.num_threads} per CTA at D = {self.dim}); the persistent forward "
                f"grid must fit at once: at most {MAX_THREADS_PER_SM // self.tiling.num_threads}")
        self._validate(self.x, self.u, self.weight, self.bias, self.y, self.mean, self.rstd,
                       self.mask)
        self._check_relations(self._samples)

    def _validate(self, x, u, weight, bias, y, mean, rstd, mask) -> int:
        """Every per-tensor rule; shared by check_support() and execute(). Returns N."""
        (n, _) = self._rows("x", x, self.dim)
        self._same_rows("u", self._rows("u", u, self.dim), n)
        self._vector("weight", weight, self.dim)
        self._vector("bias", bias, self.dim)
        self._same_rows("y", self._rows("y", y, self.segments * self.dim), n)
        self._same_rows("mean", self._vector("mean", mean, None, torch.float32, 4), n)
        self._same_rows("rstd", self._vector("rstd", rstd, None, torch.float32, 4), n)
        self._mask(mask, n)
        return n

    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        def build():
            from ..kernels.fake import (cute_dtype, fake_rows, fake_stream, fake_vector,
                                        rows_symbol, scalar)
            from ..kernels.lmsd_fwd_sm90 import LmsdForwardSm90
            import cutlass
            dt = cute_dtype(dtype_name(self.dtype))
            n = rows_symbol()
            kernel = LmsdForwardSm90(dt, self.dim, self.apply_u_silu, self.concat_u,
                                     self.concat_x, self.use_dropout, self.vecs_per_thread,
                                     self.ctas_per_sm)
            mask = fake_rows(cutlass.Int8, n, self.dim, packed=True) if self.use_dropout else None
            args = (fake_rows(dt, n, self.dim), fake_rows(dt, n, self.dim),
                    fake_vector(dt, self.dim), fake_vector(dt, self.dim),
                    fake_rows(dt, n, self.segments * self.dim),
                    fake_vector(cutlass.Float32, n, align=4), fake_vector(cutlass.Float32, n, align=4), mask,
                    fake_vector(cutlass.Int32, SCHEDULER_COUNTER_SHAPE[0], align=4),
                    scalar(cutlass.Float32, 1e-5), scalar(cutlass.Int64, 0),
                    scalar(cutlass.Float32, 1.0), scalar(cutlass.Int64, 0),
                    scalar(cutlass.Int32, 1), fake_stream())
            return kernel, args
        return {"fwd": build}

    @property
    def ctas_per_sm(self) -> int:
        """CTAs per SM of the persistent forward grid."""
        return self.min_ctas_per_sm or max(1, FWD_THREADS_PER_SM // self.tiling.num_threads)

    @staticmethod
    def workspace_shape() -> Tuple[int, ...]:
        """Shape of the int32 scheduler counter ``execute(workspace=...)`` takes: zero it
        once; every launch leaves it zero. Launches that may run concurrently (different
        streams) need different workspaces."""
        return SCHEDULER_COUNTER_SHAPE

    def execute(self, x, u, weight, bias, y, mean, rstd, mask=None, *, seed: int = 0,
                eps: Optional[float] = None, dropout_ratio: Optional[float] = None, stream=None,
                workspace: Optional[torch.Tensor] = None):
        """Writes y, mean, rstd (and mask) for these inputs. Allocates nothing when
        ``workspace`` is given (else the op keeps one per device and stream, made on the
        first execute there: execute once on a stream before capturing a graph on it)."""
        if not self._checked:
            self.check_support()
        def validate():
            count = self._validate(x, u, weight, bias, y, mean, rstd, mask)
            if workspace is not None:
                check_tensor("workspace", workspace, dtypes=(torch.int32,),
                             shape=SCHEDULER_COUNTER_SHAPE, align=4, contiguous=True)
            self._check_relations(dict(x=x, u=u, weight=weight, bias=bias, y=y, mean=mean,
                                       rstd=rstd, mask=mask, workspace=workspace))
            return count

        n = self._validated((x, u, weight, bias, y, mean, rstd, mask, workspace), validate)
        eps = self.eps if eps is None else eps
        check_finite("eps", eps, positive=True)
        threshold, scale = self._runtime_dropout(dropout_ratio)
        seed = check_int64("seed", seed)
        kernels = self._ready(x.device.index)
        if n == 0:
            return
        index = x.device.index
        handle = stream_handle(stream, index)
        if workspace is None:
            workspace = own_scheduler_counter(self._workspaces, index, handle,
                                              "HstuLmsdFwdSm90")
        rows_per_cta = self.tiling.rows_per_cta
        num_ctas = min(sm_count(index) * self.ctas_per_sm, -(-n // rows_per_cta))
        with device_guard(index):
            kernels["fwd"](x, u, weight, bias, y, mean, rstd, mask, workspace, float(eps),
                           threshold, scale, seed, num_ctas, handle)


class HstuLmsdBwdSm90(_LmsdBase):
    """Gradients of HstuLmsdFwdSm90 given dy and the forward's mean, rstd and mask.

    dweight/dbias are reduced deterministically through an fp32 workspace whose shape
    ``workspace_shape(device)`` gives; pass one to execute() (the allocating function
    does), so execute allocates nothing and is safe in CUDA graph capture.
    """

    kernel_sources = ("precast.kernels.lmsd_bwd_sm90",) + _SM90_SOURCES
    OUTPUTS = ("dx", "du", "dweight", "dbias", "workspace")

    def __init__(self, sample_dy, sample_x, sample_u, sample_weight, sample_bias, sample_mean,
                 sample_rstd, sample_mask=None, sample_dx=None, sample_du=None,
                 sample_dweight=None, sample_dbias=None, *, dropout_ratio: float = 0.0,
                 apply_u_silu: bool = True, concat_u: bool = False, concat_x: bool = False,
                 compute_dweight: bool = True, vecs_per_thread: Optional[int] = None,
                 min_ctas_per_sm: Optional[int] = None):
        super().__init__()
        desc = TensorDesc.optional
        self.dy, self.x, self.u = desc(sample_dy), desc(sample_x), desc(sample_u)
        self.weight, self.bias = desc(sample_weight), desc(sample_bias)
        self.mean, self.rstd, self.mask = desc(sample_mean), desc(sample_rstd), desc(sample_mask)
        self._init_common(self.x.dtype, self.x.shape[-1] if self.x.ndim else 0, dropout_ratio,
                          apply_u_silu, concat_u, concat_x, vecs_per_thread, min_ctas_per_sm,
                          "bwd")
        self.compute_dweight = compute_dweight
        n = self.x.shape[0] if self.x.ndim else 0
        self.dx = desc(sample_dx) or TensorDesc(self.dtype, (n, self.dim))
        self.du = desc(sample_du) or TensorDesc(self.dtype, (n, self.dim))
        self.dweight = desc(sample_dweight)
        if self.dweight is None and compute_dweight and sample_dweight is None:
            self.dweight = TensorDesc(self.dtype, (self.dim,))
        self.dbias = desc(sample_dbias) or TensorDesc(self.dtype, (self.dim,))
        self._samples = dict(dy=sample_dy, x=sample_x, u=sample_u, weight=sample_weight,
                             bias=sample_bias, mean=sample_mean, rstd=sample_rstd,
                             mask=sample_mask, dx=sample_dx, du=sample_du,
                             dweight=sample_dweight, dbias=sample_dbias)

    def static_config(self) -> Dict[str, object]:
        return {"dtype": dtype_name(self.dtype), "dim": self.dim, "apply_u_silu": self.apply_u_silu,
                "concat_u": self.concat_u, "concat_x": self.concat_x,
                "dropout": self.use_dropout, "compute_dweight": self.compute_dweight,
                "vecs_per_thread": self.vecs_per_thread, "min_ctas_per_sm": self.min_ctas_per_sm}

    @classmethod
    def from_config(cls, dtype="bfloat16", dim=512, apply_u_silu=True, concat_u=False,
                    concat_x=False, dropout=True, compute_dweight=True, vecs_per_thread=None,
                    min_ctas_per_sm=None):
        dt = parse_dtype(dtype)
        n = 1024
        rows = TensorDesc(dt, (n, dim))
        vec = TensorDesc(dt, (dim,))
        stat = TensorDesc(torch.float32, (n,))
        dy = TensorDesc(dt, (n, segment_count(concat_u, concat_x) * dim))
        mask = TensorDesc(torch.int8, (n, dim)) if dropout else None
        return cls(dy, rows, rows, vec, vec, stat, stat, mask,
                   dropout_ratio=0.5 if dropout else 0.0, apply_u_silu=apply_u_silu,
                   concat_u=concat_u, concat_x=concat_x, compute_dweight=compute_dweight,
                   vecs_per_thread=vecs_per_thread, min_ctas_per_sm=min_ctas_per_sm)

    def workspace_shape(self, device=None) -> Tuple[int, int, int]:
        """fp32 (rows, slots, D): one row per row group of the persistent grid."""
        idx = device.index if isinstance(device, torch.device) else device
        sms = sm_count(idx if idx is not None else torch.cuda.current_device())
        per_sm = max(BWD_CTAS_PER_SM, self.min_ctas_per_sm)
        return (sms * per_sm * self.tiling.rows_per_cta, self.workspace_slots, self.dim)

    @property
    def workspace_slots(self) -> int:
        """dbias, plus dweight when it is computed."""
        return 2 if self.compute_dweight else 1

    def make_workspace(self, device=None) -> torch.Tensor:
        return torch.empty(self.workspace_shape(device), dtype=torch.float32,
                           device=device if device is not None else "cuda")

    def _check(self) -> None:
        self._check_common()
        check_bool("compute_dweight", self.compute_dweight)
        self._validate(self.dy, self.x, self.u, self.weight, self.bias, self.mean, self.rstd,
                       self.mask, self.dx, self.du, self.dweight, self.dbias)
        self._check_relations({**self._samples, "workspace": None})

    def _validate(self, dy, x, u, weight, bias, mean, rstd, mask, dx, du, dweight, dbias) -> int:
        (n, _) = self._rows("x", x, self.dim)
        self._same_rows("dy", self._rows("dy", dy, self.segments * self.dim), n)
        self._same_rows("u", self._rows("u", u, self.dim), n)
        self._vector("weight", weight, self.dim)
        self._vector("bias", bias, self.dim)
        self._same_rows("mean", self._vector("mean", mean, None, torch.float32, 4), n)
        self._same_rows("rstd", self._vector("rstd", rstd, None, torch.float32, 4), n)
        self._mask(mask, n)
        self._same_rows("dx", self._rows("dx", dx, self.dim), n)
        self._same_rows("du", self._rows("du", du, self.dim), n)
        if self.compute_dweight:
            check_value(dweight is not None, ValueError,
                        "dweight is required when compute_dweight=True")
            self._vector("dweight", dweight, self.dim, align=2)
        else:
            check_value(dweight is None, ValueError,
                        "dweight must be None when compute_dweight=False")
        self._vector("dbias", dbias, self.dim, align=2)
        return n

    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        def build_rows():
            from ..kernels.fake import (cute_dtype, fake_rows, fake_stream, fake_vector,
                                        fake_workspace, rows_symbol, scalar)
            from ..kernels.lmsd_bwd_sm90 import LmsdBackwardSm90
            import cutlass
            dt = cute_dtype(dtype_name(self.dtype))
            n = rows_symbol()
            kernel = LmsdBackwardSm90(dt, self.dim, self.apply_u_silu, self.concat_u,
                                      self.concat_x, self.use_dropout, self.compute_dweight,
                                      self.vecs_per_thread, self.min_ctas_per_sm)
            mask = fake_rows(cutlass.Int8, n, self.dim, packed=True) if self.use_dropout else None
            args = (fake_rows(dt, n, self.segments * self.dim), fake_rows(dt, n, self.dim),
                    fake_rows(dt, n, self.dim), fake_vector(dt, self.dim), fake_vector(dt, self.dim),
                    fake_vector(cutlass.Float32, n, align=4), fake_vector(cutlass.Float32, n, align=4), mask,
                    fake_rows(dt, n, self.dim), fake_rows(dt, n, self.dim),
                    fake_workspace(self.workspace_slots, self.dim), scalar(cutlass.Float32, 1.0),
                    scalar(cutlass.Int32, 1), fake_stream())
            return kernel, args

        def build_reduce():
            from ..kernels.fake import cute_dtype, fake_stream, fake_vector, fake_workspace, scalar
            from ..kernels.lmsd_bwd_sm90 import LmsdParamGradReduceSm90
            import cutlass
            dt = cute_dtype(dtype_name(self.dtype))
            kernel = LmsdParamGradReduceSm90(dt, self.dim, self.compute_dweight)
            dweight = fake_vector(dt, self.dim, align=2) if self.compute_dweight else None
            args = (fake_workspace(self.workspace_slots, self.dim),
                    fake_vector(dt, self.dim, align=2), dweight, scalar(cutlass.Int32, 1),
                    fake_stream())
            return kernel, args
        return {"rows": build_rows, "reduce": build_reduce}

    def execute(self, dy, x, u, weight, bias, mean, rstd, mask, dx, du, dweight, dbias,
                workspace, *, dropout_ratio: Optional[float] = None, stream=None):
        """Writes dx, du, dbias (and dweight). ``workspace``: fp32 of workspace_shape()."""
        if not self._checked:
            self.check_support()
        def validate():
            count = self._validate(dy, x, u, weight, bias, mean, rstd, mask, dx, du, dweight,
                                   dbias)
            check_tensor("workspace", workspace, dtypes=(torch.float32,),
                         shape=(None, self.workspace_slots, self.dim), contiguous=True)
            self._check_relations(dict(dy=dy, x=x, u=u, weight=weight, bias=bias, mean=mean,
                                       rstd=rstd, mask=mask, dx=dx, du=du, dweight=dweight,
                                       dbias=dbias, workspace=workspace))
            return count

        n = self._validated((dy, x, u, weight, bias, mean, rstd, mask, dx, du, dweight, dbias,
                             workspace), validate)
        _, scale = self._runtime_dropout(dropout_ratio)
        rows_per_cta = self.tiling.rows_per_cta
        capacity = workspace.shape[0] // rows_per_cta
        check_value(capacity >= 1, ValueError,
                    f"workspace: needs at least {rows_per_cta} rows; see workspace_shape()")
        num_ctas = max(1, min(capacity, -(-n // rows_per_cta)))
        index = x.device.index
        kernels = self._ready(index)
        with device_guard(index):
            handle = stream_handle(stream, index)
            kernels["rows"](dy, x, u, weight, bias, mean, rstd, mask, dx, du, workspace, scale,
                            num_ctas, handle)
            kernels["reduce"](workspace, dbias, dweight, num_ctas * rows_per_cta, handle)
