"""PyTorch: ``TorchInput`` (``torch_input.py``), its sink of torch tensors (``pinned_sink.py``) and the copy to the
training device (``device_prefetch.py``); the input state as a ``state_dict`` (``checkpoint_state.py``).

Modules here import PyTorch as ``import torch`` (absolute imports: this package is ``stoker.consumer.torch`` and
never shadows it). Importing this package imports nothing; ``stoker.consumer.TorchInput`` loads the facade.
"""
