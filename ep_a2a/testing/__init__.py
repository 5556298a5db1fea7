"""The oracles and the harness: NumPy references of dispatch/combine (reference.py), of the MoE
compute pieces (moe_reference.py) and of the whole MoE layer (layer_oracle.py); random inputs
(formats.py); the step runner that checks real ranks byte for byte (harness.py). Used by the
demo, the tests and the tools; built on ep_a2a's public API only, except hooks.py: the testing
interface into a rank that the benchmarks and tests use."""
