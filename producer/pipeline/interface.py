"""The ``Pipeline`` interface a user's code plugs into (the package's doc says how): declared ``Field``s, checked
when made (PipelineError), and ``Pipeline.write``, which makes one sample into its rows of a batch and holds it to
the declaration (SampleError naming the field, the expected and the actual).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from stoker.protocol import ALLOWED_DTYPES
from stoker.protocol.batch_spec import BOOKKEEPING, LENGTH_SUFFIX, bookkeeping_arrays, shape_text

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,59}$")  # leaves room for the _len suffix within 64


class PipelineError(ValueError):
    """A pipeline cannot be loaded or declares something invalid; the message says what and how to fix it."""


class SampleError(ValueError):
    """One sample does not match the pipeline's fields (or its function raised); the record is skipped."""


@dataclass(frozen=True)
class UpTo:
    """A variable dimension of at most ``max`` (see ``upto``)."""

    max: int

    def __repr__(self) -> str:
        return f"<={self.max}"


def upto(maximum: int) -> UpTo:
    """A first dimension that varies per sample, at most ``maximum``: ``Field("boxes", "float32", (upto(100), 4))``."""
    return UpTo(int(maximum))


Dim = Union[int, UpTo]


@dataclass(frozen=True)
class Field:
    """One array of a sample: ``name``, numpy ``dtype`` name and per-sample ``shape`` (no batch dimension).

    The first dimension may be ``upto(N)``: variable, at most N.
    """

    name: str
    dtype: str
    shape: tuple[Dim, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, self.name))
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def variable(self) -> bool:
        return bool(self.shape) and isinstance(self.shape[0], UpTo)

    @property
    def max_shape(self) -> tuple[int, ...]:
        """The shape of this field's row in a batch (variable dimension at its maximum)."""
        return tuple(d.max if isinstance(d, UpTo) else d for d in self.shape)

    def __str__(self) -> str:
        return f"{self.name} {self.dtype} {shape_text(self.shape)}"


def _dtype_name(dtype: Any, name: str) -> str:
    try:
        resolved = np.dtype(dtype).name
    except TypeError:
        raise PipelineError(f"field {name!r}: {dtype!r} is not a numpy dtype") from None
    if resolved not in ALLOWED_DTYPES:
        raise PipelineError(f"field {name!r}: dtype {resolved} cannot travel; use one of {sorted(ALLOWED_DTYPES)}")
    return resolved


SampleFn = Callable[[Mapping[str, Any], np.random.Generator], Mapping[str, Any]]
FillFn = Callable[[Mapping[str, Any], np.random.Generator, dict[str, np.ndarray]], Optional[Mapping[str, int]]]


@dataclass
class Pipeline:
    """Declared ``fields`` plus exactly one of ``sample`` or ``fill`` (see the module doc).

    ``stage_times``, optional: returns and resets ``{"decode": seconds}`` spent decoding inside the
    function, so producer metrics can split decode from augment (built-ins provide it; without it
    all of the function's time counts as augment).
    """

    fields: Sequence[Field]
    sample: Optional[SampleFn] = None
    fill: Optional[FillFn] = None
    name: str = ""
    stage_times: Optional[Callable[[], Mapping[str, float]]] = None
    _by_name: dict[str, Field] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.fields = tuple(self.fields)
        check_fields(self.fields)
        if (self.sample is None) == (self.fill is None):
            raise PipelineError("a Pipeline needs exactly one of sample=fn(record, rng) -> dict or "
                                "fill=fn(record, rng, rows)")
        fn = self.sample or self.fill
        if not callable(fn):
            raise PipelineError(f"the pipeline's {'sample' if self.sample else 'fill'} must be callable, got {fn!r}")
        self._by_name = {f.name: f for f in self.fields}

    def batch_arrays(self, exact: bool = False) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """Every array of a batch, in wire order: ``(name, dtype, per-sample shape)``.

        ``exact``: batches also carry ``mask`` (bool per row): rows that are padding or failed are False.
        """
        out = []
        for f in self.fields:
            out.append((f.name, f.dtype, f.max_shape))
            if f.variable:
                out.append((f.name + LENGTH_SUFFIX, "int32", ()))
        return (*out, *((name, dtype, ()) for name, dtype in bookkeeping_arrays(exact)))

    def describe(self) -> str:
        return ", ".join(str(f) for f in self.fields)

    def write(self, record: Mapping[str, Any], rng: np.random.Generator, rows: dict[str, np.ndarray]) -> None:
        """Make one sample into ``rows`` (this sample's row of every batch array). SampleError on any problem."""
        if self.fill is not None:
            try:
                lengths = self.fill(record, rng, rows) or {}
            except SampleError:
                raise
            except Exception as exc:
                raise SampleError(f"the pipeline's fill function raised {type(exc).__name__}: {exc}") from exc
            for f in self.fields:
                if f.variable:
                    if f.name not in lengths:
                        raise SampleError(f"fill did not return the length of variable field {f.name!r}")
                    rows[f.name + LENGTH_SUFFIX][...] = _check_length(f, lengths[f.name])
            return
        try:
            made = self.sample(record, rng)  # type: ignore[misc]
        except SampleError:
            raise
        except Exception as exc:
            raise SampleError(f"the pipeline's sample function raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(made, Mapping):
            raise SampleError(f"the sample function returned {type(made).__name__}, expected a dict of "
                              f"{', '.join(self._by_name)}")
        missing = [n for n in self._by_name if n not in made]
        extra = [n for n in made if n not in self._by_name]
        if missing or extra:
            raise SampleError(f"the sample has fields {sorted(made)}, the pipeline declares {list(self._by_name)}"
                              + (f" (missing {missing})" if missing else "") + (f" (undeclared {extra})" if extra else ""))
        for f in self.fields:
            value = _as_array(f, made[f.name])
            if f.variable:
                n = _check_length(f, value.shape[0])
                row = rows[f.name]
                row[:n] = value
                row[n:] = 0
                rows[f.name + LENGTH_SUFFIX][...] = n
            else:
                rows[f.name][...] = value


def _check_length(f: Field, n: Any) -> int:
    maximum = f.shape[0].max  # type: ignore[union-attr]
    if not isinstance(n, (int, np.integer)) or not 0 <= int(n) <= maximum:
        raise SampleError(f"field {f.name!r} has {n} rows, more than the {maximum} declared "
                          f"(upto({maximum})): raise the maximum or cut the sample")
    return int(n)


def _as_array(f: Field, value: Any) -> np.ndarray:
    """``value`` as an array of ``f``'s dtype and shape; SampleError naming the field otherwise."""
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        array = np.asarray(value)
        if array.dtype.name != f.dtype:
            raise SampleError(f"field {f.name!r} is {array.dtype.name}, the pipeline declares {f.dtype} "
                              f"(convert it with .astype(np.{f.dtype}))")
    else:  # Python numbers and lists: converted, but never silently wrapped or truncated
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise SampleError(f"field {f.name!r}: {type(value).__name__} is not an array ({exc})") from None
        if array.dtype.kind not in "biuf" or array.dtype == object:
            raise SampleError(f"field {f.name!r} is {type(value).__name__} of {array.dtype}, not numbers")
        converted = array.astype(f.dtype)
        if array.size and not np.array_equal(converted, array) and np.dtype(f.dtype).kind in "biu":
            raise SampleError(f"field {f.name!r}: {value!r} does not fit {f.dtype}")
        array = converted
    expected = f.shape
    if array.ndim != len(expected) or any(not isinstance(d, UpTo) and d != s for d, s in zip(expected, array.shape)):
        raise SampleError(f"field {f.name!r} has shape {list(array.shape)}, the pipeline declares {list(expected)}")
    return array


def check_fields(fields: Sequence[Field]) -> None:
    """PipelineError for invalid or clashing field declarations."""
    if not fields:
        raise PipelineError("a pipeline must declare at least one field")
    seen: set[str] = set()
    for f in fields:
        if not isinstance(f, Field):
            raise PipelineError(f"fields must be stoker.producer.pipeline.Field, got {f!r}")
        if not _NAME_RE.match(f.name):
            raise PipelineError(f"field name {f.name!r} must match {_NAME_RE.pattern}")
        if f.name in BOOKKEEPING:
            raise PipelineError(f"field name {f.name!r} is reserved: Stoker adds {', '.join(BOOKKEEPING)} itself")
        if f.name in seen:
            raise PipelineError(f"field {f.name!r} is declared twice")
        seen.add(f.name)
        for i, d in enumerate(f.shape):
            if isinstance(d, UpTo):
                if i != 0:
                    raise PipelineError(f"field {f.name!r}: only the first dimension may be upto(N), got {list(f.shape)}")
                if d.max < 1:
                    raise PipelineError(f"field {f.name!r}: upto({d.max}) needs a maximum >= 1")
            elif not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
                raise PipelineError(f"field {f.name!r}: dimension {d!r} must be an integer >= 0 or upto(N)")
    for f in fields:
        if f.variable and f.name + LENGTH_SUFFIX in seen:
            raise PipelineError(f"field {f.name + LENGTH_SUFFIX!r} clashes with the length Stoker adds for {f.name!r}")
