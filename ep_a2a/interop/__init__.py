"""Buffers as framework-neutral tensors: the DLPack protocol (dlpack.py), the Tensor that
speaks it and the CUDA array interface (tensor.py), and helpers to make them (arrays.py)."""
