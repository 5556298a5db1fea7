"""MoE layers on the rank-major all-to-all: ep_a2a.layers.torch (PyTorch), ep_a2a.layers.jax
(JAX), and what they share (base.py). Each framework is imported only when its layer is used:
importing this package imports neither."""
