"""ep_a2a under torchrun: one rank per process, the group formed through torch.distributed,
dispatch -> simulated experts -> combine on PyTorch tensors, every step checked.

    python -m torch.distributed.run --nproc-per-node 2 examples/torch_distributed.py [--steps 3] [--tokens 16]
    mpirun -n 2 python examples/torch_distributed.py --mpi          # the same, the group formed through mpi4py

Every call is ep_a2a's public API: TorchDistributedBootstrap (or MpiBootstrap) -> ProcessGroup
-> MoeAlltoAll; per step RankAlltoAll.dispatch, combine_input, combine, with torch tensors
passed through DLPack and everything on torch's current stream. Ranks take GPUs round-robin
(LOCAL_RANK % visible GPUs); processes sharing one GPU time-slice it, so keep --steps small
there. The handles travel over a Unix socket: one node. As root, Open MPI's mpirun needs
OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1. Rank 0 prints one line per step
and a summary; exits 1 on a mismatch, 2 or 3 (one line) when something is missing.
"""
import argparse
import os

from preflight import MISSING, fail, require_module, require_torch_cuda, require_torchrun

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--tokens", type=int, default=16, help="max tokens per rank")
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--protocol", default="fence", choices=["fence", "sentinel", "auto"])
ap.add_argument("--mpi", action="store_true", help="form the group through mpi4py instead of torch.distributed")
args = ap.parse_args()

require_module("torch", "pip install torch (a CUDA build)")
if args.mpi:
    MPI = require_module("mpi4py.MPI", "pip install mpi4py")
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", MPI.COMM_WORLD.Get_rank())))
    os.environ.setdefault("LOCAL_RANK", str(local))  # (preflight: one process speaks for the node)
else:
    _, _, local = require_torchrun()
torch = require_torch_cuda()
gpu = local % torch.cuda.device_count()
torch.cuda.set_device(gpu)

import ep_a2a  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ep_a2a.moe import local_experts  # noqa: E402

if args.mpi:
    bootstrap = ep_a2a.MpiBootstrap(MPI.COMM_WORLD)
else:
    dist.init_process_group("gloo")   # small host-side messages only; the all-to-all never uses it
    bootstrap = ep_a2a.TorchDistributedBootstrap()
rank = bootstrap.rank
if bootstrap.world_size < 2:
    fail(MISSING, "needs at least 2 processes (--nproc-per-node 2)")

# Step sizes must agree across ranks (every rank passes the same T^), so rank 0 draws the seed
# they come from; each rank draws its own tokens from a generator of its own.
sizes = torch.Generator().manual_seed(int.from_bytes(bootstrap.allgather(os.urandom(8) if rank == 0 else b"")[0], "little") >> 1)
mine = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
dev = torch.device("cuda", gpu)
failed = 0
with ep_a2a.ProcessGroup(bootstrap, device=gpu) as group:
    ep, T, H, K = group.ep_size, args.tokens, args.hidden, args.top_k
    E = 4 * ep
    first, n_local = local_experts(E, ep, rank)
    scale = (1.0 + torch.arange(E, device=dev) % 5) / 4    # the simulated expert e: y = scale[e] * x
    with ep_a2a.MoeAlltoAll(group, max_tokens_per_rank=T, top_k=K, num_experts=E,
                            payloads=[ep_a2a.PayloadSpec("hidden", (H,), "float32"),
                                      ep_a2a.PayloadSpec("weights", (K,), "float32")],
                            combine_hidden_size=H, combine_dtype="float32", protocol=args.protocol,
                            timeout_s=120.0, first_timeout_s=300.0) as a2a:
        r = a2a.ranks[0]                                    # this process's rank
        stream = torch.cuda.current_stream()                # every launch on torch's stream
        for step in range(args.steps):
            counts = torch.randint(1, T + 1, (ep,), generator=sizes)
            T_hat = int(counts.max())               # the same T^ on every rank
            t = int(counts[rank])
            ids = torch.rand(t, E, device=dev, generator=mine).argsort(dim=1)[:, :K].to(torch.int32)
            ids[torch.rand(t, K, device=dev, generator=mine) < 0.1] = -1    # -1: no expert
            x = torch.randn(t, H, device=dev, generator=mine)
            w = torch.rand(t, K, device=dev, generator=mine)

            ids_v, (x_v, w_v) = r.dispatch(ids, [x, w], runtime_max_tokens_per_rank=T_hat, stream=stream)
            # received, rank-major: [ep, T^, ...]; slots without a token carry id -1
            rids, rx, rw = (torch.from_dlpack(v) for v in (ids_v, x_v, w_v))
            own = (rids >= first) & (rids < first + n_local)
            factor = torch.where(own, rw * scale[rids.clamp(min=0).long()], 0).sum(dim=-1, keepdim=True)
            partial = torch.where(own.any(dim=-1, keepdim=True), factor * rx, 0)
            torch.from_dlpack(r.combine_input(T_hat)).copy_(partial)    # the experts' output, in place
            y = torch.from_dlpack(r.combine(r.combine_input(T_hat), T_hat, stream=stream))   # [t, H]

            want = torch.where(ids >= 0, w * scale[ids.clamp(min=0).long()], 0).sum(dim=1, keepdim=True) * x
            ok = torch.allclose(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            failed += not ok
            if not ok:
                print(f"rank {rank} step {step}: MISMATCH, max |error| {float((y - want).abs().max()):.3g}", flush=True)
            if rank == 0:
                print(f"step {step}: T^={T_hat} tokens per rank {counts.tolist()}: rank 0 combine "
                      f"{'matches' if ok else 'MISMATCH'}", flush=True)
        bad = [int(b) for b in bootstrap.allgather(str(failed).encode())]
bootstrap.close()
if rank == 0:
    print(f"{'MPI' if args.mpi else 'torch.distributed'} bootstrap, {ep} processes, {args.steps} steps: "
          f"{'all ranks match the reference' if not any(bad) else f'mismatches per rank {bad}'}", flush=True)
if not args.mpi:
    dist.destroy_process_group()
raise SystemExit(1 if any(bad) else 0)
