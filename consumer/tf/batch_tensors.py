"""One batch's tensors, by name and unpacked: what ``ZMQInput.get()`` and ``dequeue()`` return.

``BatchTensors`` is a tuple of the pipeline's own fields in declared order, so
``images, labels = inp.get()`` reads naturally, and indexable by name for every
array of the batch, Stoker's included: ``batch["boxes"]``, ``batch["boxes_len"]``,
``batch["index"]``, ``batch["epoch"]``. ``select`` picks arrays by a name, a
sequence of names or a dict of names, for ``as_dataset(x=..., y=...)``.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Sequence, Union

Selection = Union[str, Sequence[str], Mapping[str, str]]


class BatchTensors(tuple):
    """Unpacks to the pipeline's fields; ``batch[name]`` gives any array; ``batch.names`` lists them all."""

    def __new__(cls, values: Sequence[Any] = (), by_name: Optional[Mapping[str, Any]] = None,
                unpacked: Optional[Sequence[str]] = None) -> "BatchTensors":
        if by_name is None:  # rebuilt by tf.nest from plain values
            obj = super().__new__(cls, values)
            obj._by_name = {}
            return obj
        names = list(unpacked if unpacked is not None else by_name)
        obj = super().__new__(cls, [by_name[n] for n in names])
        obj._by_name = dict(by_name)
        return obj

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return self._by_name[key]
            except KeyError:
                raise KeyError(f"this batch has no array {key!r}; it has {', '.join(self._by_name)}") from None
        return tuple.__getitem__(self, key)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self._by_name.items())

    def as_dict(self) -> dict[str, Any]:
        return dict(self._by_name)


def check_selection(selection: Selection, names: Sequence[str], what: str) -> None:
    """ValueError naming the unknown arrays of ``selection`` (``what`` says which argument)."""
    wanted = [selection] if isinstance(selection, str) else list(selection.values()) if isinstance(
        selection, Mapping) else list(selection)
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted:
        raise ValueError(f"{what}={selection!r}: the batches have {', '.join(names)}; choose among those")


def select(arrays: Mapping[str, Any], selection: Selection) -> Any:
    """One tensor, a tuple or a dict of tensors, as ``selection`` names them."""
    if isinstance(selection, str):
        return arrays[selection]
    if isinstance(selection, Mapping):
        return {key: arrays[name] for key, name in selection.items()}
    return tuple(arrays[name] for name in selection)
