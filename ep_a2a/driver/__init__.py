"""Thin layer over cuda.bindings.driver: errors, devices, modules, launches, VMM, DLPack tensors.

Nothing here knows about MoE.
"""
from .errors import CudaError, EpA2AError, NoDriverError, call, check
from .device import Device, available, device_count, get_device, init

__all__ = ["CudaError", "EpA2AError", "NoDriverError", "call", "check",
           "Device", "available", "device_count", "get_device", "init"]
