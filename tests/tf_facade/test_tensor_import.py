"""Arrays into TensorFlow with one copy: aligned, owned by TensorFlow, buffers reused once TensorFlow lets go."""

from __future__ import annotations

import gc

import numpy as np
import tensorflow as tf

from stoker.consumer.tf.tensor_import import ALIGN, TensorImporter


def _address(tensor: tf.Tensor) -> int:
    """Where the tensor's bytes live (through DLPack, which shares them)."""
    return np.from_dlpack(tensor).ctypes.data


def test_a_large_array_is_copied_once_into_aligned_memory_the_tensor_owns():
    importer = TensorImporter()
    n = 3 * 128 * 128 * 3
    frame = np.frombuffer(bytearray(b"\0" * 16) + (np.arange(n) % 251).astype(np.uint8).tobytes(), np.uint8,
                          offset=16 + 3)[: n - 3]  # deliberately misaligned, like a libzmq frame
    array = frame.reshape(-1, 3)
    assert array.ctypes.data % ALIGN != 0
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


def test_the_pool_is_bounded():
    importer = TensorImporter(max_pooled_bytes=1 << 20)
    tensors = [importer.to_tensor(np.zeros(600_000, np.uint8)) for _ in range(3)]
    del tensors
    gc.collect()
    assert importer.pooled_bytes == 600_000  # a second would pass the 1 MiB bound: freed instead


def test_labels_indices_and_masks_take_the_same_aligned_path_and_keep_their_values():
    importer = TensorImporter()
    # Small arrays as a frame delivers them: views at odd offsets of one buffer.
    raw = np.zeros(1 + 8 * 8 + 4 * 8 + 8, np.uint8)
    index = np.frombuffer(raw, np.int64, count=8, offset=1)
    labels = np.frombuffer(raw, np.int32, count=8, offset=1 + 64)
    mask = np.frombuffer(raw, np.bool_, count=8, offset=1 + 64 + 32)
    raw[1:65] = np.arange(8, dtype=np.int64).view(np.uint8)
    raw[65:97] = np.arange(100, 108, dtype=np.int32).view(np.uint8)
    raw[97:105] = [1, 0, 1, 1, 0, 1, 1, 1]
    tensors = [importer.to_tensor(a) for a in (index, labels, mask)]
    raw[:] = 0  # the frame is freed: the tensors keep their own copies
    assert [_address(t) % ALIGN for t in tensors] == [0, 0, 0]
    assert tensors[0].dtype == tf.int64 and tensors[0].numpy().tolist() == list(range(8))
    assert tensors[1].dtype == tf.int32 and int(tf.reduce_sum(tensors[1])) == sum(range(100, 108))
    assert tensors[2].dtype == tf.bool and tensors[2].numpy().tolist() == [True, False, True, True, False, True, True, True]
    del tensors
    gc.collect()
    assert importer.pooled_bytes == 64 + 32 + 8  # each went through a pooled buffer, not a plain conversion
    assert importer.to_tensor(np.zeros((0, 4), np.float32)).shape == (0, 4)
