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

# The door users import from (``from stoker.producer.pipeline import Field, Pipeline``): what a pipeline declares
# and how it writes a sample is ``interface``; finding and building one from ``--pipeline`` is ``loading``.
from stoker.producer.pipeline.interface import (Dim, Field, FillFn, Pipeline, PipelineError, SampleError, SampleFn,
                                                UpTo, check_fields, upto)
from stoker.producer.pipeline.loading import BUILTIN, load_pipeline, resolve

__all__ = ["Field", "Pipeline", "PipelineError", "SampleError", "UpTo", "upto", "Dim", "SampleFn", "FillFn",
           "check_fields", "load_pipeline", "resolve", "BUILTIN"]
