"""NumPy: ``BatchStream`` (``batch_stream.py``), batches as dicts of NumPy arrays for JAX, PyTorch or any framework;
its sink is the floor's ``receive.queue_sink.QueueSink``. Never imports TensorFlow or PyTorch.

Modules here import NumPy as ``import numpy as np`` (absolute imports: this package is ``stoker.consumer.numpy`` and
never shadows it). Importing this package imports nothing; ``stoker.consumer.BatchStream`` loads the facade.
"""
