"""Where the user's preprocessing plugs in: declared output fields plus a per-sample function.

A ``Pipeline`` turns one record (a dict of the dataset's fields, see docs/format.md)
and an ``rng`` into one sample: named numpy arrays matching its declared ``Field``
list. Stoker owns the rest: worker processes, batching into shared memory,
transport, backpressure, shutdown, metrics. A ten-line pipeline::

    import numpy as np
    from stoker.producer.images.decode import decode_rgb
    from stoker.producer.pipeline import Field, Pipeline

    def make_pipeline(size: int = 64) -> Pipeline:
        def sample(record, rng):
            image = decode_rgb(record["image"])[:size, :size]       # your decoding and augmentation
            if rng.random() < 0.5:
                image = image[:, ::-1]
            padded = np.zeros((size, size, 3), np.uint8)
            padded[: image.shape[0], : image.shape[1]] = image
            return {"images": padded, "labels": record["label"]}
        return Pipeline([Field("images", "uint8", (size, size, 3)), Field("labels", "int32", ())], sample=sample)

and ``stoker produce --pipeline my_module:make_pipeline --pipeline-arg size=96``.

The function comes in one of two forms:

- ``sample(record, rng) -> {name: array}``: Stoker checks each array against its
  field and copies it into the batch. numpy arrays must have the declared dtype;
  Python numbers and lists are converted to it.
- ``fill(record, rng, rows) -> {name: length} | None``: writes into ``rows``, this
  sample's row of each batch array in shared memory (no copy: the built-in
  ``imagenet`` pipeline resizes straight into it); returns the length of each
  variable-length field it filled.

Variable length: a field whose first dimension is ``upto(N)`` (e.g. boxes
``(upto(100), 4)``) is batched padded with zeros to N, with an int32
``<name>_len`` array holding each sample's true length (docs/decisions.md says
why padded rather than ragged). ``index`` and ``epoch`` (int64 and int32: which
record, which epoch) are added to every batch by Stoker.

Randomness: use only ``rng``. It is derived from (seed, epoch, record index), so
a run with ``--seed`` is reproducible and a record gets the same augmentation
however batches are composed and workers split.

Errors: a pipeline whose declaration is wrong raises PipelineError when loaded
(the daemon refuses to start and says why); a sample that does not match its
fields, or a function that raises, gives SampleError naming the field, the
expected and the actual: the worker skips that record, counts and logs it,
and carries on.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from stoker.protocol import ALLOWED_DTYPES
from stoker.protocol.batch_spec import BOOKKEEPING, LENGTH_SUFFIX, bookkeeping_arrays, shape_text

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,59}$")  # leaves room for the _len suffix within 64
BUILTIN = ("imagenet", "detection", "segmentation")


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


# ---- loading ---------------------------------------------------------------------------------

def _builtin(name: str) -> Callable[..., Pipeline]:
    from stoker.producer.images import builtin_pipelines

    return getattr(builtin_pipelines, f"make_{name}")


def resolve(ref: str) -> Callable[..., Pipeline] | Pipeline:
    """The factory (or Pipeline) ``ref`` names: a built-in, ``package.module:attr`` or ``path/file.py:attr``."""
    if ref in BUILTIN:
        return _builtin(ref)
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise PipelineError(f"--pipeline {ref!r}: expected one of {', '.join(BUILTIN)}, "
                            "package.module:function or path/to/file.py:function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise PipelineError(f"--pipeline {ref!r}: no file {path}")
        module_name = f"stoker_user_pipeline_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise PipelineError(f"--pipeline {ref!r}: importing {path} raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PipelineError(f"--pipeline {ref!r}: cannot import {target} ({exc}); is it installed or on "
                                "PYTHONPATH?") from exc
        except Exception as exc:
            raise PipelineError(f"--pipeline {ref!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise PipelineError(f"--pipeline {ref!r}: {target} has no {attr!r} (it has {', '.join(names[:12])})")
    if not isinstance(found, Pipeline) and not callable(found):
        raise PipelineError(f"--pipeline {ref!r}: {attr} is a {type(found).__name__}, not a Pipeline or a function "
                            "returning one")
    return found


def _convert(value: str, parameter: inspect.Parameter, ref: str) -> Any:
    kind = parameter.annotation if parameter.annotation is not inspect.Parameter.empty else (
        type(parameter.default) if parameter.default not in (inspect.Parameter.empty, None) else str)
    if isinstance(kind, str):  # postponed annotations ("int")
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, str)
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes", "on")
        if kind in (int, float):
            return kind(value)
    except ValueError:
        raise PipelineError(f"--pipeline-arg {parameter.name}={value}: {ref} expects {kind.__name__}") from None
    return value


def load_pipeline(ref: str, args: Mapping[str, str] | None = None, standard: Mapping[str, Any] | None = None) -> Pipeline:
    """Build the pipeline ``ref`` names with ``args`` (``--pipeline-arg`` strings, converted to the factory's types).

    ``standard`` (``mode``, ``image_size`` from ``stoker produce``) reaches the factory only for parameters it
    declares (or ``**kwargs``), and never overrides ``args``. PipelineError says what went wrong.
    """
    args, standard = dict(args or {}), dict(standard or {})
    found = resolve(ref)
    if isinstance(found, Pipeline):
        if args:
            raise PipelineError(f"--pipeline {ref!r} names a Pipeline, not a function: it takes no --pipeline-arg")
        return found
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        signature = None
    kwargs: dict[str, Any] = {}
    if signature is not None:
        params = signature.parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key, value in args.items():
            if key in params:
                kwargs[key] = _convert(value, params[key], ref)
            elif var_kw:
                kwargs[key] = value
            else:
                accepted = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                raise PipelineError(f"--pipeline-arg {key}: {ref} takes {', '.join(accepted) or 'no arguments'}")
        for key, value in standard.items():
            if key not in kwargs and (key in params or var_kw):
                kwargs[key] = value
    else:
        kwargs = {**args}
    try:
        made = found(**kwargs)
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"--pipeline {ref!r}: making the pipeline raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, Pipeline):
        raise PipelineError(f"--pipeline {ref!r} returned {type(made).__name__}, expected a "
                            "stoker.producer.pipeline.Pipeline")
    if not made.name:
        made.name = ref
    return made
