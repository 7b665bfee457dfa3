"""The base class of every op: construct -> check_support() -> compile() -> execute()."""
from __future__ import annotations

import json
from typing import Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type

import torch

from .arch import device_arch, target_arch
from .cache import ArtifactCache, CacheKey, KernelBuilder, default_cache, source_fingerprint

OP_REGISTRY: Dict[str, Type["Op"]] = {}

_device_arch_cache: Dict[int, Optional[str]] = {}


class Op:
    """Subclasses define:

    - ``supported_archs``: targets their kernels are written for;
    - ``kernel_sources``: modules whose source is fingerprinted into the cache key;
    - ``host_sources`` (optional): other host modules that build its kernels' fake
      arguments (fingerprinted as well, like the op's own module);
    - ``static_config()``: the JSON-able values that select the generated code;
    - ``from_config(**static_config)``: an instance made of descriptors alone (for precompile);
    - ``_check()``: every rule knowable before launch;
    - ``_kernel_builders()``: name -> callable returning (cute.jit function, fake args);
    - ``execute(...)``.
    """

    supported_archs: ClassVar[Tuple[str, ...]] = ()
    kernel_sources: ClassVar[Tuple[str, ...]] = ()
    host_sources: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):
            OP_REGISTRY[cls.__name__] = cls

    def __init__(self):
        self._checked = False
        self._kernels: Optional[Dict[str, Callable]] = None
        self._arch: Optional[str] = None
        self._last_layout: Optional[tuple] = None  # (layout key, validation result)

    # --- subclass interface ------------------------------------------------------------
    def static_config(self) -> Dict[str, object]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, **config) -> "Op":
        raise NotImplementedError

    def _check(self) -> None:
        raise NotImplementedError

    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        raise NotImplementedError

    # --- the lifecycle -----------------------------------------------------------------
    def check_support(self) -> "Op":
        self._check()
        self._checked = True
        return self

    def cache_key(self, arch: Optional[str] = None) -> CacheKey:
        # The op's own module builds the fake arguments and argument order: fingerprint it too.
        sources = self.kernel_sources + (type(self).__module__,) + self.host_sources
        return CacheKey.make(type(self).__name__, self.static_config(), target_arch(arch),
                             source_fingerprint(sources))

    def build_command(self, arch: str) -> str:
        cfg = json.dumps(self.static_config(), sort_keys=True)
        return f"python -m precast precompile --op {type(self).__name__} --config '{cfg}' --arch {arch}"

    def compile(self, arch: Optional[str] = None, cache: Optional[ArtifactCache] = None) -> "Op":
        """Loads the kernels from the cache, building them first where the compiler is present."""
        if not self._checked:
            self.check_support()
        arch = target_arch(arch)
        if arch not in self.supported_archs:
            raise NotImplementedError(
                f"{type(self).__name__} has kernels for {', '.join(self.supported_archs)}, "
                f"not {arch}")
        key = self.cache_key(arch)
        self._kernels = (cache or default_cache()).get(key, self._kernel_builders(),
                                                       self.build_command(arch))
        self._arch = arch
        return self

    @property
    def is_compiled(self) -> bool:
        return self._kernels is not None

    def _validated(self, tensors: tuple, validate: Callable[[], object], extra: tuple = ()):
        """``validate()`` (every per-tensor and cross-tensor rule of execute) once per
        distinct layout of ``tensors``: a call with the same tensors as the last successful
        one (address, shape, strides, dtype, device; what every rule reads), and the same
        ``extra`` (hashable: the scalars and container keys the rules also read), returns
        that call's result without re-running the rules, which cost ~10 us of Python per
        tensor (a serving loop that reuses its buffers pays them once). Failures are not
        kept; results must hold no tensors (the op would keep a caller's buffers alive)."""
        if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
            return validate()  # descriptors, or a wrong type the rules will name
        key = (tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype,
                                             t.device) for t in tensors), extra)
        last = self._last_layout  # one read: another thread may replace it
        if last is not None and last[0] == key:
            return last[1]
        result = validate()
        self._last_layout = (key, result)
        return result

    @staticmethod
    def _layout_items(container) -> Tuple[tuple, object]:
        """(the tensors, a hashable description) of an optional tuple, list or dict of
        tensors, for _validated: its entries and their count or keys."""
        if container is None:
            return (), None
        if isinstance(container, Mapping):
            return tuple(container.values()), ("dict", tuple(container.keys()))
        if isinstance(container, (tuple, list)):
            return tuple(container), ("seq", len(container))
        return (container,), ("other",)  # not a tensor: the rules will name it

    def _ready(self, device_index: int) -> Dict[str, Callable]:
        """Kernels for execute(): compiles (loads) on first use and checks the device."""
        if self._kernels is None:
            self.compile()
        arch = _device_arch_cache.get(device_index)
        if arch is None:
            arch = _device_arch_cache[device_index] = device_arch(device_index)
        if arch != self._arch:
            raise RuntimeError(f"{type(self).__name__} was compiled for {self._arch} but "
                               f"cuda:{device_index} is {arch}")
        return self._kernels
