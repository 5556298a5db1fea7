"""The testing interface: what the benchmarks (ep_a2a/tools/bench*.py) and the tests reach
into a rank for, kept off the public classes and the hot path. Not part of the API: these
calls follow the library's internals and may change with them.

  launch_empty(rank, stream, grid)  an empty kernel of the protocol kernels' shape (the latency floor)
  last_grids(rank)                  (dispatch, combine) grids of the last step's protocol
  abandon_dispatch(rank)            forget a FENCE dispatch awaiting its combine (dispatch-only graphs)
  dry_run(on_launch)                launches counted instead of issued (the host work around them)
"""
from __future__ import annotations

import contextlib

from ..driver.launch import Launch
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


@contextlib.contextmanager
def dry_run(on_launch=None):
    """Within the block every Launch is counted instead of issued: what is left is the host
    work around the launches (the benchmark's Python-side share of the host time). Yields the
    list of (Launch, stream) calls skipped; on_launch(launch, stream), if given, sees each one
    while its arguments are as launched. Copies still run. (It swaps Launch.__call__ for the
    block, so that the launch path itself reads no flag.)"""
    skipped, issue = [], Launch.__call__

    def skip(launch, stream):
        skipped.append((launch, stream))
        if on_launch is not None:
            on_launch(launch, stream)
    Launch.__call__ = skip
    try:
        yield skipped
    finally:
        Launch.__call__ = issue
