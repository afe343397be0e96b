"""What crosses from the sandbox, where learner code ran, back to the grader: plain data only.

In the sandbox, `dumps(plain(value))` turns tensors into numpy arrays, numpy scalars and other
numbers (`fractions.Fraction`, `decimal.Decimal`, any `numbers.Real`) into builtin Python numbers
and anything else it does not know into an `Opaque` description of it. In the grader,
`loads(data)` unpickles with a whitelist of constructors: bytes written by learner code (the
sandbox is theirs, so they could write anything into the pipe) can describe values, never run code.
An `Opaque` is read back as an instance of a class named after the learner's type, so feedback
that names `type(value).__name__` says "it is a MyResult", never the transport's own name.
"""
from __future__ import annotations

import decimal
import functools
import io
import numbers
import pickle

import numpy as np

MAX_BYTES = 256 * 2**20  # a check's data is small; more is a runaway learner process


class Opaque:
    """A value the sandbox could not turn into plain data: its type's name and a short repr."""
    __slots__ = ("type_name", "text")

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __reduce__(self):
        return (Opaque, (self.type_name, self.text))

    def __eq__(self, other):
        return isinstance(other, Opaque) and (self.type_name, self.text) == (other.type_name, other.text)

    def __hash__(self):
        return hash((self.type_name, self.text))

    def __repr__(self):
        return self.text


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
    if isinstance(value, np.generic):  # before numbers.Number, which numpy's scalars also register as
        return value.item() if value.dtype.kind in "biufc" else Opaque(type(value).__name__, repr(value)[:80])
    if isinstance(value, (numbers.Number, decimal.Decimal)):
        return _other_number(value)
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


def _other_number(value):
    """A number of another type (an exact `Fraction` or `Decimal`, a learner's `numbers.Real`) as
    the builtin number it stands for: an integral value as an exact int, others as a float. The
    conversions call the value's own methods, here in the sandbox, where learner code runs anyway;
    their results pass through `_builtin_number`, so nothing but a builtin number leaves."""
    try:
        if isinstance(value, decimal.Decimal):  # not a numbers.Real, though it is a real number
            if value.is_finite() and value == value.to_integral_value():
                return _builtin_number(int(value))
            return _builtin_number(float(value))
        if isinstance(value, numbers.Rational) and _builtin_number(value.denominator) == 1:
            return _builtin_number(value.numerator)
        if isinstance(value, numbers.Integral):
            return _builtin_number(int(value))
        if isinstance(value, numbers.Real):
            return _builtin_number(float(value))
        if isinstance(value, numbers.Complex):
            return _builtin_number(complex(value))
    except BaseException:  # noqa: BLE001 - a learner's conversion may raise anything
        pass
    return Opaque(type(value).__name__, _short_repr(value))


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


@functools.lru_cache(maxsize=256)
def _opaque_class(type_name: str) -> type:
    """A subclass of Opaque named after the learner's type: feedback written as "it is a
    {type(value).__name__}" then names what the learner returned."""
    return type(type_name, (Opaque,), {"__slots__": ()})


def _read_opaque(type_name, text) -> Opaque:
    """How the grader rebuilds an Opaque. Both fields come from the sandbox and may be forged:
    only a short printable name becomes a class name, and the text stays a string."""
    name = type_name if isinstance(type_name, str) else "value"
    name = "".join(c for c in name[:80] if c.isprintable()) or "value"
    return _opaque_class(name)(name, text[:200] if isinstance(text, str) else "")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise UnreadableData(f"it refers to {module}.{name}, which is not plain data")
        if (module, name) == ("grader.transport", "Opaque"):
            return _read_opaque
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
