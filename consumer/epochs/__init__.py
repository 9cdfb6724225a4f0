"""Epochs as PyTorch and Keras users expect them: one epoch at a time, ranks ending each epoch together (held_rows.py:
splitting batches at an epoch boundary; epoch_loop.py: the loop every iterable facade shares)."""
