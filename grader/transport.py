"""What crosses from the sandbox, where learner code ran, back to the grader: plain data only.

In the sandbox, `dumps(plain(value))` turns tensors into numpy arrays, numpy scalars into Python
numbers and anything else it does not know into an `Opaque` description of it. In the grader,
`loads(data)` unpickles with a whitelist of constructors: bytes written by learner code (the
sandbox is theirs, so they could write anything into the pipe) can describe values, never run code.
"""
from __future__ import annotations

import io
import pickle
from typing import NamedTuple

import numpy as np

MAX_BYTES = 256 * 2**20  # a check's data is small; more is a runaway learner process


class Opaque(NamedTuple):
    """A value the sandbox could not turn into plain data: its type and a short repr."""
    type_name: str
    text: str


class UnreadableData(Exception):
    """The bytes from the sandbox are not data the grader accepts."""


def plain(value, depth: int = 0):
    """`value` as numbers, strings, bools, None, numpy arrays, lists, tuples and dicts."""
    import torch  # the sandbox has it loaded already; the grader imports transport before torch

    if depth > 20:
        return Opaque("nesting", "deeper than 20 levels")
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, (int, float, complex)):
        return _builtin_number(value)
    if isinstance(value, np.generic):
        return value.item() if value.dtype.kind in "biufc" else Opaque(type(value).__name__, repr(value)[:80])
    if isinstance(value, torch.Tensor):
        if value.is_meta or value.layout != torch.strided:
            return Opaque("Tensor", f"a {value.layout} tensor on {value.device}")
        return value.detach().cpu().clone().resolve_conj().resolve_neg().numpy() \
            if value.dtype != torch.bfloat16 else Opaque("Tensor", "a bfloat16 tensor")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufcU":
            return np.array(value, copy=True)
        return Opaque("ndarray", f"an array of dtype {value.dtype}")
    if isinstance(value, (list, tuple)):
        items = [plain(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in value.items()
                if isinstance(k, (str, int, float, bool, tuple))}
    return Opaque(type(value).__name__, _short_repr(value))


def _builtin_number(value):
    """The builtin number a number is, read through the builtin types' own slots: a subclass
    (which could override comparisons or conversions) becomes a plain int, float or complex."""
    if isinstance(value, bool):
        return value  # bool cannot be subclassed
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return complex(complex.real.__get__(value), complex.imag.__get__(value))


def _short_repr(value) -> str:
    try:
        return repr(value)[:80]
    except BaseException:  # noqa: BLE001 - a learner's __repr__ may raise anything
        return f"<{type(value).__name__}>"


def dumps(value) -> bytes:
    return pickle.dumps(value, protocol=5)


# Every global a pickle of plain data refers to. Nothing here can reach the file system or run code.
_ALLOWED = {
    ("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "bytearray"), ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
    ("grader.transport", "Opaque"),
}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise UnreadableData(f"it refers to {module}.{name}, which is not plain data")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnreadableData("it refers to an external object")


def loads(data: bytes):
    """Plain data from bytes the sandbox sent; UnreadableData if they hold anything else."""
    if len(data) > MAX_BYTES:
        raise UnreadableData(f"it is {len(data) / 2**20:.0f} MiB, more than the {MAX_BYTES >> 20} MiB a check reads")
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except UnreadableData:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or forged bytes fail in many ways
        raise UnreadableData(f"it is not a readable pickle ({type(exc).__name__})") from None
