"""Results that unpack like a tuple and index like a dict (``y, mean, rstd, mask = r``;
``r["y_tensor"]``; ``r.y_tensor``)."""
from __future__ import annotations

from typing import Tuple


class Results(tuple):
    _fields: Tuple[str, ...] = ()

    def __new__(cls, *values, **named):
        if named:
            if values:
                raise TypeError(f"{cls.__name__}: pass values positionally or by name, not both")
            missing = set(cls._fields) - set(named)
            extra = set(named) - set(cls._fields)
            if missing or extra:
                raise TypeError(f"{cls.__name__}: missing {sorted(missing)}, unexpected {sorted(extra)}")
            values = tuple(named[f] for f in cls._fields)
        if len(values) != len(cls._fields):
            raise TypeError(f"{cls.__name__} takes {len(cls._fields)} values, got {len(values)}")
        return super().__new__(cls, values)

    def __getitem__(self, item):
        if isinstance(item, str):
            try:
                return tuple.__getitem__(self, self._fields.index(item))
            except ValueError:
                raise KeyError(f"{item!r}; {type(self).__name__} has {list(self._fields)}") from None
        return tuple.__getitem__(self, item)

    def __getattr__(self, name):
        if name in type(self)._fields:
            return self[name]
        raise AttributeError(name)

    def keys(self):
        return list(self._fields)

    def items(self):
        return list(zip(self._fields, self))

    def __contains__(self, item):
        return item in self._fields if isinstance(item, str) else tuple.__contains__(self, item)

    def __repr__(self):
        inner = ", ".join(f"{k}={_short(v)}" for k, v in zip(self._fields, self))
        return f"{type(self).__name__}({inner})"


def _short(value):
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"Tensor{list(shape)}:{str(value.dtype).replace('torch.', '')}"
    return repr(value)


def results_type(name: str, fields: Tuple[str, ...]):
    return type(name, (Results,), {"_fields": tuple(fields), "__slots__": ()})
