"""SENTINEL phase profile: in-kernel %globaltimer stamps (profiling build of sentinel.cu, ep_prof)."""
import sys, ctypes, numpy as np
import ep_a2a
from ep_a2a.tools import bench
from ep_a2a.tools.bench_cli import parse_args
from ep_a2a.driver.module import load
from cuda.bindings import driver as drv

NAMES = {0: "d.entry", 1: "d.gdwait", 2: "d.ready", 3: "d.pushed", 4: "d.sent", 5: "d.ids", 6: "d.landed",
         7: "d.copied", 8: "d.end", 9: "c.entry", 10: "c.gdwait", 11: "c.pushed", 12: "c.srcs", 13: "c.polled", 14: "c.end"}

def main():
    args = parse_args(["--protocol", "sentinel", "--tokens", sys.argv[1]] + sys.argv[2:])
    with ep_a2a.LocalGroup([0] * args.ranks) as group:
        b = bench.Bench(args, group, 12345)
        try:
            mod = load("sentinel", group.ranks[0].device)
            err, dptr, size = drv.cuModuleGetGlobal(mod.handle, b"ep_prof")
            assert err == 0, err
            b.a2a.use_protocol('sentinel')
            for T in args.tokens:
                a = b.a2a; ranks = a.ranks
                ins, ids = b._inputs(T)
                def rt():
                    for (x, pays), r in zip(ins, ranks):
                        r.dispatch(x, pays, T)
                    for r in ranks:
                        r.combine(b._combine_input(r, T), T)
                rt(); a.synchronize()
                g = b._graph(rt, rounds=20)
                samples = []
                times = []
                for rep in range(12):
                    host = np.zeros(size // 8, np.uint64)
                    drv.cuMemsetD8(dptr, 0, size)
                    times.append(b._replay(g))
                    group.ranks[0].stream.synchronize()
                    drv.cuMemcpyDtoH(host.ctypes.data, dptr, size)
                    samples.append(host.reshape(8, 64, 32).astype(np.int64))
                g.close()
                grids = ranks[0].last_grids
                print(f"== T={T} graph of 20 rounds: median {np.median(times)/20:.2f} us/round (incl. launch/20); grids {grids}")
                S = np.stack(samples[2:])  # [reps, rank, block, 32]
                gt = S[..., :16]
                nd, nc = grids[0], grids[1]
                # reference: per rep, min over ranks and blocks of d.gdwait
                ref = gt[:, :, :nd, 1].min(axis=(1, 2))[:, None, None]
                rel = (gt - ref[..., None]) / 1000.0
                print("stamp      " + " ".join(f"b{k:<5d}" for k in range(min(nc, 14))))
                for k in list(range(0, 9)):
                    row = np.median(rel[:, :, :nd, k], axis=(0, 1))
                    print(f"{NAMES[k]:10s} " + " ".join(f"{v:6.2f}" for v in row[:14]))
                for k in range(9, 15):
                    row = np.median(rel[:, :, :nc, k], axis=(0, 1))
                    print(f"{NAMES[k]:10s} " + " ".join(f"{v:6.2f}" for v in row[:14]))
                # next step start: not available; print round period
                clk = S[..., 16:]
                d = (clk[:, :, :nd, 6] - clk[:, :, :nd, 2])
                print(f"clock cycles d.ready->d.landed median {np.median(d):.0f}; d.gdwait->d.ready {np.median(clk[:, :, :nd, 2]-clk[:, :, :nd, 1]):.0f}")
                print(f"globaltimer distinct deltas (ns) sample: {sorted(set(np.diff(np.sort(gt[0,0,:nd,:9].ravel())).tolist()))[:10]}")
        finally:
            b.close()

main()
