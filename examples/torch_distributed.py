"""ep_a2a under torchrun: one rank per process, the group formed through torch.distributed,
dispatch/combine through the torch ops, every byte checked against the NumPy reference.

    torchrun --nproc-per-node=2 examples/torch_distributed.py [--steps 3] [--tokens 16]
    mpirun -n 2 python examples/torch_distributed.py --mpi         # the same through mpi4py

As root (containers), Open MPI's mpirun refuses to start unless OMPI_ALLOW_RUN_AS_ROOT=1 and
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set in its environment.

Ranks take GPUs round-robin (LOCAL_RANK % visible GPUs): two processes on one GPU time-slice
it, so keep --steps small there (each wait across processes costs milliseconds). Prints one
line per step from rank 0 and exits non-zero if any rank saw a mismatch.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import ep_a2a  # noqa: E402
from ep_a2a.ops import torch as ep_ops  # noqa: E402
from ep_a2a.testing.formats import payload_formats  # noqa: E402
from ep_a2a.testing.torch_step import run_torch_step  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--tokens", type=int, default=16, help="max tokens per rank")
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--protocol", default="fence", choices=["fence", "sentinel", "auto"])
ap.add_argument("--mpi", action="store_true", help="form the group through mpi4py instead of torch.distributed")
args = ap.parse_args()

if args.mpi:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, local = comm.Get_rank(), int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.Get_rank()))
    bootstrap = ep_a2a.MpiBootstrap(comm)
else:
    import torch.distributed as dist
    dist.init_process_group("gloo")   # bytes travel on the CPU; fds go over a Unix socket (one node)
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    bootstrap = ep_a2a.TorchDistributedBootstrap()
gpu = local % torch.cuda.device_count()
torch.cuda.set_device(gpu)

# one seed for all ranks: every process draws every rank's inputs and checks its own
seed = int.from_bytes(bootstrap.allgather(os.urandom(8) if rank == 0 else b"")[0], "little")
rng = np.random.default_rng(seed)
failed = 0
with ep_a2a.ProcessGroup(bootstrap, device=gpu) as group:
    ep, T, H, K = group.ep_size, args.tokens, args.hidden, args.top_k
    with ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=4 * ep,
                            payloads=payload_formats(H, K)["bf16"], combine_hidden_size=H,
                            protocol=args.protocol, timeout_s=120.0, first_timeout_s=300.0) as a2a:
        tr = ep_ops.bind(a2a.ranks[0])   # this process's rank, as torch ops
        for step in range(args.steps):
            tmax = int(rng.integers(1, T + 1))
            tokens = [int(rng.integers(0, tmax + 1)) for _ in range(ep)]
            rep = run_torch_step(a2a, [tr], rng, tokens, tmax, out_given=step % 2 == 0)
            failed += len(rep.mismatches)
            for m in rep.mismatches[:5]:
                print(f"rank {rank} step {step}: MISMATCH {m}", flush=True)
            if rank == 0:
                print(f"step {step}: T^={tmax} tokens={tokens} checked {rep.dispatch_bytes_checked} dispatched bytes, "
                      f"{rep.combine_rows_checked} combined rows on rank 0: {'ok' if not rep.mismatches else 'MISMATCH'}",
                      flush=True)
        bad = [int(x) for x in bootstrap.allgather(str(failed).encode())]
    tr.release()
bootstrap.close()
if rank == 0:
    print(f"{'torch.distributed' if not args.mpi else 'MPI'} bootstrap, {ep} processes, {args.steps} steps: "
          f"{'all ranks match the reference' if not any(bad) else f'mismatches per rank {bad}'}", flush=True)
if not args.mpi:
    dist.destroy_process_group()
sys.exit(1 if failed else 0)
