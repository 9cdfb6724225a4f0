"""What a batch carries: the name, dtype and shape of each of its arrays.

A trainer holds every producer to one BatchSpec: declared up front or learned
from the first batch (``BatchSpec.of``). ``check`` raises BatchMismatchError
naming what the producer sends and what the trainer expects, with the flag to
change when the difference is only the batch or image size. Shapes are whole
batch shapes (batch dimension first); the arrays keep the order of the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .batch_header import ALLOWED_DTYPES, Batch
from .errors import ProtocolError

#: The arrays Stoker producers add to every batch, last and in this order (docs/protocol.md, "What a Stoker batch
#: carries"): ``(name, dtype)``, one value per row (``[B]`` on the wire): the record's index in the dataset (-1 for
#: padding) and the epoch of its sample.
BOOKKEEPING_ARRAYS: tuple[tuple[str, str], ...] = (("index", "int64"), ("epoch", "int32"))
#: Exact mode's batches carry one more, after those: whether the row is a real sample (False: padding or failed).
EXACT_MASK: tuple[str, str] = ("mask", "bool")
#: Names no pipeline may use for a field of its own.
BOOKKEEPING = tuple(name for name, _ in (*BOOKKEEPING_ARRAYS, EXACT_MASK))
LENGTH_SUFFIX = "_len"


def bookkeeping_arrays(exact: bool) -> tuple[tuple[str, str], ...]:
    """``(name, dtype)`` of the arrays Stoker adds after a pipeline's own, in wire order: ``index``, ``epoch`` and,
    in exact mode (``exact``), ``mask``. Producers append them; trainers declaring a spec expect them."""
    return (*BOOKKEEPING_ARRAYS, EXACT_MASK) if exact else BOOKKEEPING_ARRAYS


def shape_text(shape: Sequence[object]) -> str:
    """A shape for people: ``[224, 224, 3]``, and ``scalar`` for ``()`` (one value: per sample in a pipeline's
    fields, where ``[]`` read as "empty")."""
    return str(list(shape)) if len(shape) else "scalar"


class BatchMismatchError(ProtocolError):
    """A well-formed batch whose arrays do not match what the trainer expects.

    ``producer`` names the producer that sent it ("" if unknown): a producer's spec does not change while it
    runs, so each of its batches will be refused the same way (the trainer fails once every producer did).
    """

    def __init__(self, message: str, producer: str = "") -> None:
        super().__init__(message)
        self.producer = producer


@dataclass(frozen=True)
class ArrayShape:
    """One array of a batch: name, dtype name and the whole batch shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name} {self.dtype} {shape_text(self.shape)}"


@dataclass(frozen=True)
class BatchSpec:
    """The arrays of a batch, in order. Build with ``BatchSpec.of(batch)`` or ``BatchSpec.from_dict``."""

    arrays: tuple[ArrayShape, ...]

    def __post_init__(self) -> None:
        names = [a.name for a in self.arrays]
        if len(set(names)) != len(names):
            raise ValueError(f"batch spec names an array twice: {names}")
        for a in self.arrays:
            if a.dtype not in ALLOWED_DTYPES:
                raise ValueError(f"array {a.name!r}: dtype {a.dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
        if self.arrays and len({a.shape[0] if a.shape else None for a in self.arrays}) != 1:
            raise ValueError(f"every array needs the same batch size as its first dimension: {self}")

    @classmethod
    def of(cls, batch: Batch) -> "BatchSpec":
        """The spec a received batch follows."""
        return cls(tuple(ArrayShape(name, a.dtype.name, tuple(a.shape)) for name, a in batch.arrays.items()))

    @classmethod
    def from_dict(cls, arrays: Mapping[str, tuple[str | np.dtype, Sequence[int]]]) -> "BatchSpec":
        """``{"images": ("uint8", [64, 224, 224, 3]), ...}`` -> BatchSpec."""
        return cls(tuple(ArrayShape(name, np.dtype(dtype).name, tuple(int(d) for d in shape))
                         for name, (dtype, shape) in arrays.items()))

    @classmethod
    def classification(cls, batch_size: int, image_shape: Sequence[int]) -> "BatchSpec":
        """What the ``imagenet`` pipeline sends: images, labels and Stoker's index and epoch."""
        return cls.from_dict({"images": ("uint8", [batch_size, *image_shape]), "labels": ("int32", [batch_size]),
                              **{name: (dtype, [batch_size]) for name, dtype in bookkeeping_arrays(exact=False)}})

    @property
    def batch_size(self) -> int:
        return self.arrays[0].shape[0] if self.arrays and self.arrays[0].shape else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arrays)

    def __getitem__(self, name: str) -> ArrayShape:
        for a in self.arrays:
            if a.name == name:
                return a
        raise KeyError(f"no array {name!r} in this batch spec (it has {', '.join(self.names)})")

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def pipeline_fields(self) -> tuple[str, ...]:
        """Names of the pipeline's own arrays: all but Stoker's bookkeeping and the ``<name>_len`` counts."""
        lengths = {f"{a.name}{LENGTH_SUFFIX}" for a in self.arrays}
        return tuple(n for n in self.names if n not in BOOKKEEPING and n not in lengths)

    def __str__(self) -> str:
        return ", ".join(str(a) for a in self.arrays)

    def check(self, batch: Batch) -> list[np.ndarray]:
        """The batch's arrays in spec order; BatchMismatchError naming both specs if it differs."""
        arrays = batch.arrays
        if len(arrays) == len(self.arrays):
            out = []
            for want in self.arrays:
                got = arrays.get(want.name)
                if got is None or got.dtype.name != want.dtype or got.shape != want.shape:
                    break
                out.append(got)
            else:
                return out
        raise BatchMismatchError(self._mismatch(batch.header.producer, [
            ArrayShape(name, a.dtype.name, tuple(a.shape)) for name, a in arrays.items()]), batch.header.producer)

    def check_declared(self, producer: str, declared: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """Hold a batch to this spec by its header alone (name, dtype name, shape of each array), before
        any of its data is read; BatchMismatchError as ``check`` raises it."""
        if len(declared) == len(self.arrays):
            by_name = {name: (dtype, tuple(shape)) for name, dtype, shape in declared}
            if all(by_name.get(a.name) == (a.dtype, a.shape) for a in self.arrays):
                return
        raise BatchMismatchError(self._mismatch(producer, [ArrayShape(n, d, tuple(s)) for n, d, s in declared]),
                                 producer)

    def _mismatch(self, producer: str, sent_arrays: Sequence[ArrayShape]) -> str:
        try:
            sent = BatchSpec(tuple(sent_arrays))
        except ValueError:  # not even a spec (batch sizes disagree, a scalar): name what came
            return f"producer {producer} sends {', '.join(map(str, sent_arrays))}; this trainer expects {self}"
        return f"producer {producer} sends {sent}; this trainer expects {self}{_hint(sent, self)}"


def _hint(sent: BatchSpec, want: BatchSpec) -> str:
    """The flag to change, when the specs differ only in batch size or image size."""
    if sent.names != want.names or [a.dtype for a in sent.arrays] != [a.dtype for a in want.arrays]:
        missing = [n for n in want.names if n not in sent.names]
        extra = [n for n in sent.names if n not in want.names]
        which = "".join([f" (the producer's batches lack {', '.join(missing)}" if missing else "",
                         f"{'; ' if missing else ' ('}they carry {', '.join(extra)} too" if extra else "",
                         ")" if missing or extra else ""])
        return (f"; producers and trainer disagree on the arrays themselves{which}: run the same --pipeline on every "
                "producer and declare its spec in the trainer (or let it learn the spec from the first batch)")
    hints = []
    if sent.batch_size != want.batch_size:
        hints.append(f"start the producers with --batch-size {want.batch_size}, or the trainer with "
                     f"batch_size={sent.batch_size} (stoker train: --batch-size {sent.batch_size})")
    if "images" in want and sent["images"].shape[1:] != want["images"].shape[1:]:
        image = want["images"].shape[1:3]
        sent_image = sent["images"].shape[1:3]
        square = len(sent_image) == 2 and sent_image[0] == sent_image[1]
        cli = (f" (stoker train: --image-size {sent_image[0]})"
               if square and sent["images"].shape[3:] == want["images"].shape[3:] else "")
        hints.append(f"start the producers with --image-size {image[0] if image[0] == image[1] else image}, or the "
                     f"trainer with image_shape={tuple(sent['images'].shape[1:])}{cli}")
    return "; " + "; ".join(hints) if hints else ""
