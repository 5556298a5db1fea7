"""ep_a2a: one-sided expert-parallel all-to-all (dispatch/combine) over NVLink symmetric memory."""
__version__ = "0.1.0"
