"""The one lifetime every owner of a resource shares: close() releases once (idempotent, also
when the release raises), a context manager, and live counts per kind for leak tests.

Only the VMM objects also free themselves when garbage-collected unclosed (with a
ResourceWarning): their memory is the scarce resource. Composites (an all-to-all, a group, a
workspace) do not, because their release synchronizes the device, and a collection can run
at any bytecode, also between two in-process ranks' launches of a phase, where a device-wide
wait would block on a kernel waiting for the next launch.
"""
from __future__ import annotations

import collections
import sys
import threading
import warnings

_live = collections.Counter()
_live_lock = threading.Lock()


def live_counts(*kinds: str) -> dict:
    """{kind: objects opened and not yet closed in this process} (all kinds when none named)."""
    with _live_lock:
        return {k: _live[k] for k in kinds} if kinds else {k: v for k, v in _live.items()}


class Owned:
    """Base of every owner: subclasses set `_kind`, call `_opened()` once they hold something
    to release (composites: first thing, so that a constructor that fails halfway can close
    what it made), and implement `_release()`."""
    _kind = None             # key in live_counts(), or None: not counted
    _closed = True
    _close_on_collect = False

    def _opened(self) -> None:
        self._closed = False
        if self._kind:
            with _live_lock:
                _live[self._kind] += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._kind:
            with _live_lock:
                _live[self._kind] -= 1
        try:
            for hook in self.__dict__.pop("_close_hooks", ()):
                hook()
        finally:
            self._release()

    def on_close(self, hook) -> None:
        """Call `hook()` when this closes, before anything of it is released: for an object
        that holds raw addresses into it (the JAX launch plans)."""
        self.__dict__.setdefault("_close_hooks", []).append(hook)

    def _release(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not self._close_on_collect:
            return
        try:
            if self._closed or sys.is_finalizing():
                return
            try:  # free even where warnings are turned into errors
                warnings.warn(f"{self!r} was garbage-collected without close(); freeing it now",
                              ResourceWarning, stacklevel=2)
            finally:
                self.close()
        except Exception:  # never raise from __del__ (the driver may be unusable by now)
            pass
