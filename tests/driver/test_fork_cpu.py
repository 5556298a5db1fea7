"""A process forked after CUDA was initialised gets one clear error from every entry point
(a real fork; the parent's initialised state is set by hand, since this machine may have no
GPU)."""
import os

from ep_a2a.driver import device as D


def test_a_forked_child_gets_a_clear_error_and_the_parent_is_untouched(monkeypatch):
    monkeypatch.setattr(D, "_initialized", True)
    dev = object.__new__(D.Device)
    dev.context = object()
    monkeypatch.setattr(D._bound, "ctx", dev.context, raising=False)  # bound in the parent: the fast path
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each entry point did, then leave without pytest's teardown
        try:
            out = []
            for entry in (D.init, dev.make_current, D.device_count):
                try:
                    entry()
                    out.append("no error")
                except D.ForkedProcessError as e:
                    out.append(f"ForkedProcessError: {e}")
            os.write(w, "\n".join(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read().splitlines()
    os.waitpid(pid, 0)
    assert len(got) == 3 and all(g.startswith("ForkedProcessError") and "'spawn'" in g for g in got), got
    assert D._initialized and not D._forked_after_init
    dev.make_current()  # the parent's fast path still holds
