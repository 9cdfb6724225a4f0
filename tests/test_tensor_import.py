"""Arrays into TensorFlow with one copy: aligned, owned by TensorFlow, buffers reused once TensorFlow lets go."""

from __future__ import annotations

import gc

import numpy as np
import tensorflow as tf

from stoker.consumer.tensor_import import ALIGN, LARGE, TensorImporter


def _address(tensor: tf.Tensor) -> int:
    """Where the tensor's bytes live (through DLPack, which shares them)."""
    return np.from_dlpack(tensor).ctypes.data


def test_a_large_array_is_copied_once_into_aligned_memory_the_tensor_owns():
    importer = TensorImporter()
    n = 3 * 128 * 128 * 3  # over LARGE: the pooled DLPack path, not a plain conversion
    frame = np.frombuffer(bytearray(b"\0" * 16) + (np.arange(n) % 251).astype(np.uint8).tobytes(), np.uint8,
                          offset=16 + 3)[: n - 3]  # deliberately misaligned, like a libzmq frame
    array = frame.reshape(-1, 3)
    assert array.nbytes >= LARGE and array.ctypes.data % ALIGN != 0
    tensor = importer.to_tensor(array)
    assert _address(tensor) % ALIGN == 0
    assert _address(tensor) != array.ctypes.data
    expected = array.copy()
    array[:] = 0  # the received frame is reused or freed: the tensor has its own copy
    np.testing.assert_array_equal(tensor.numpy(), expected)
    assert tensor.dtype == tf.uint8 and tuple(tensor.shape) == expected.shape
    del tensor
    gc.collect()
    assert importer.pooled_bytes == array.nbytes  # it was a pooled buffer


def test_a_buffer_goes_back_to_the_pool_when_tensorflow_frees_the_tensor_and_is_reused():
    importer = TensorImporter()
    array = np.ones((256, 1024), np.float32)
    tensor = importer.to_tensor(array)
    first = _address(tensor)
    assert importer.pooled_bytes == 0  # in use
    del tensor
    gc.collect()
    assert importer.pooled_bytes == array.nbytes
    again = importer.to_tensor(array * 2)
    assert _address(again) == first and importer.pooled_bytes == 0
    np.testing.assert_array_equal(again.numpy(), array * 2)


def test_a_tensor_queued_in_a_fifo_queue_keeps_its_buffer_until_dequeued_and_dropped():
    importer = TensorImporter()
    queue = tf.queue.FIFOQueue(4, [tf.int32], shapes=[(512, 64)])
    arrays = [np.full((512, 64), i, np.int32) for i in range(3)]
    for a in arrays:
        queue.enqueue([importer.to_tensor(a)])
    gc.collect()
    assert importer.pooled_bytes == 0  # the queue holds all three
    for i in range(3):
        out = queue.dequeue()
        assert int(out[0, 0]) == i and int(tf.reduce_max(out)) == i
        del out
    gc.collect()
    assert importer.pooled_bytes == 3 * arrays[0].nbytes


def test_the_pool_is_bounded_and_small_or_bool_arrays_convert_plainly():
    importer = TensorImporter(max_pooled_bytes=1 << 20)
    tensors = [importer.to_tensor(np.zeros(600_000, np.uint8)) for _ in range(3)]
    del tensors
    gc.collect()
    assert importer.pooled_bytes == 600_000  # a second would pass the 1 MiB bound: freed instead
    small = importer.to_tensor(np.arange(8, dtype=np.int64))
    mask = importer.to_tensor(np.ones(100_000, np.bool_))
    assert small.numpy().tolist() == list(range(8)) and bool(tf.reduce_all(mask))
