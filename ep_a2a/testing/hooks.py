"""The testing interface: what the benchmarks (ep_a2a/tools/bench*.py) and the tests reach
into a rank for, kept off the public classes and the hot path. Not part of the API: these
calls follow the library's internals and may change with them.

  launch_empty(rank, stream, grid)  an empty kernel of the protocol kernels' shape (the latency floor)
  last_grids(rank)                  (dispatch, combine) grids of the last step's protocol
  abandon_dispatch(rank)            forget a FENCE dispatch awaiting its combine (dispatch-only graphs)
  dry_run()                         launches counted instead of issued (driver.launch.dry_run)
"""
from __future__ import annotations

from ..driver.launch import dry_run  # noqa: F401 (re-exported: the benchmark's host-time split)
from ..driver.stream import stream_handle
from ..errors import StateError


def last_grids(rank) -> tuple:
    """(dispatch, combine) grids of the last step's protocol (the benchmark's floor shape)."""
    return tuple(launch.grid for launch in rank.plan.launches[rank.last_protocol])


def launch_empty(rank, stream=None, grid: int = 1) -> None:
    """The benchmark's latency floor: an empty kernel of the protocol kernels' shape."""
    empty = rank.plan.empty
    empty.grid = grid
    rank.device.make_current()
    empty(rank.default_stream if stream is None else stream_handle(stream))


def abandon_dispatch(rank) -> None:
    """Forget the dispatch awaiting its combine, so that the next call may be a dispatch (for
    dispatch-only CUDA graphs: the benchmark times FENCE's alone). FENCE only: SENTINEL resets
    its landing slots in place, and a peer's next push could land before that reset."""
    if rank.mid_step and rank.last_protocol == "sentinel":
        raise StateError(f"rank {rank.rank}: abandon_dispatch after a SENTINEL dispatch: its slots are reused only "
                         "after a combine")
    rank.forget_dispatch()
