"""Owned.on_close: hooks run once, before anything is released, and a failing hook still
lets the owner release."""
import pytest

from ep_a2a.driver.lifetime import Owned


class _Held(Owned):
    def __init__(self, log):
        self.log = log
        self._opened()

    def _release(self):
        self.log.append("released")


def test_hooks_run_once_before_the_release():
    log = []
    h = _Held(log)
    h.on_close(lambda: log.append("first"))
    h.on_close(lambda: log.append("second"))
    h.close()
    h.close()
    assert log == ["first", "second", "released"]


def test_a_failing_hook_still_releases():
    log = []
    h = _Held(log)

    def fail():
        raise RuntimeError("hook failed")
    h.on_close(fail)
    with pytest.raises(RuntimeError, match="hook failed"):
        h.close()
    assert log == ["released"] and h.closed
