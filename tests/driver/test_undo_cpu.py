"""vmm's undo stack: a construction that fails part way undoes what it made, newest first,
and raises its own error even when an undo step fails; one that completes undoes nothing."""
import pytest

from ep_a2a.driver import vmm


def test_a_failed_construction_undoes_its_steps_newest_first_and_keeps_its_error():
    done = []

    def failing_undo():
        done.append("unmap")
        raise RuntimeError("the undo's own failure")
    with pytest.raises(KeyError, match="set access"):
        with vmm._UndoStack() as undo:
            undo.push(done.append, "free range")
            undo.push(failing_undo)
            undo.push(done.append, "release")
            raise KeyError("set access")
    assert done == ["release", "unmap", "free range"]


def test_a_completed_construction_undoes_nothing():
    done = []
    with vmm._UndoStack() as undo:
        undo.push(done.append, "free")
    assert done == []
