"""A torch stream made current for a stretch of calls, as `with torch.cuda.stream(s):` does, at
a fraction of its host cost.

torch's context manager resolves the device through several Python layers and builds a
Stream object at every entry (about 8 µs on the H200's host, four times per rank in an eager
MoE layer step); here the stream's three ids are read once and torch's own setter is called
with them. Where those private accessors are missing, or the stream is not on the current
device (torch's context then switches the device too), torch's context manager runs instead.
"""
from __future__ import annotations

import torch

_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_FAST = None not in (_get_stream, _set_stream, _get_device)


class OnStream:
    """`with OnStream(s):` (made once, entered any number of times, nested too): s is torch's
    current stream of its device inside, the one current before it after."""

    __slots__ = ("stream", "_ids", "_saved")

    def __init__(self, stream):
        self.stream = stream
        self._ids = (stream.stream_id, stream.device_index, stream.device_type)
        self._saved = []

    def __enter__(self):
        ids = self._ids
        if _FAST and _get_device() == ids[1]:
            self._saved.append(_get_stream(ids[1]))
            _set_stream(*ids)
        else:
            ctx = torch.cuda.stream(self.stream)
            ctx.__enter__()
            self._saved.append(ctx)
        return self.stream

    def __exit__(self, *exc) -> None:
        prev = self._saved.pop()
        if type(prev) is tuple:
            _set_stream(*prev)
        else:
            prev.__exit__(*exc)
