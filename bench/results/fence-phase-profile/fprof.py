"""FENCE phase profile: in-kernel %globaltimer stamps (profiling build of fence.cu, ep_prof[2][8][160][16],
indexed by the step's parity), read after replays of a graph of 20 round trips."""
import sys
import numpy as np
import ep_a2a
from ep_a2a.tools import bench
from ep_a2a.tools.bench_cli import parse_args
from ep_a2a.driver.module import load
from cuda.bindings import driver as drv

NAMES = {0: "d.entry", 1: "d.gdwait", 2: "d.ready", 3: "d.pushed", 4: "d.elected", 5: "d.counts", 6: "d.end",
         7: "d.published", 8: "c.entry", 9: "c.gdwait", 10: "c.flags", 11: "c.item1", 12: "c.end"}


def main():
    args = parse_args(["--protocol", "fence", "--tokens", sys.argv[1]] + sys.argv[2:])
    with ep_a2a.LocalGroup([0] * args.ranks) as group:
        b = bench.Bench(args, group, 12345)
        try:
            mod = load("fence", group.ranks[0].device)
            err, dptr, size = drv.cuModuleGetGlobal(mod.handle, b"ep_prof")
            assert int(err) == 0, err
            b.a2a.use_protocol("fence")
            for T in args.tokens:
                a = b.a2a
                ranks = a.ranks
                ins, ids = b._inputs(T)

                def rt():
                    for (x, pays), r in zip(ins, ranks):
                        r.dispatch(x, pays, T)
                    for r in ranks:
                        r.combine(b._combine_input(r, T), T)
                rt()
                a.synchronize()
                g = b._graph(rt, rounds=20)
                samples, times = [], []
                for rep in range(14):
                    host = np.zeros(size // 8, np.uint64)
                    drv.cuMemsetD8(dptr, 0, size)
                    times.append(b._replay(g))
                    group.ranks[0].stream.synchronize()
                    drv.cuMemcpyDtoH(host.ctypes.data, dptr, size)
                    samples.append(host.reshape(2, 8, 160, 16).astype(np.int64))
                g.close()
                nd, nc = ranks[0].last_grids[0], ranks[0].last_grids[1]
                print(f"== T={T}: {np.median(times) / 20:.2f} us/round (graph of 20, launch included); grids dispatch {nd} combine {nc}")
                rows = {}
                for S in samples[2:]:
                    last = int(np.argmax([S[q, :, :nd, 1].max() for q in range(2)]))
                    cur, prev = S[last], S[1 - last]
                    ref = cur[:, :nd, 1].min()
                    cur, prev = cur - ref, prev - ref  # offsets first: float64 medians of absolute ns round to 256 ns

                    def rel(x):
                        return x / 1e3
                    pc = prev[:, :nc, 12]
                    rows.setdefault("prev c.end", []).append([rel(pc.min()), rel(np.median(pc)), rel(pc.max())])
                    for k in range(0, 7):
                        x = cur[:, :nd, k]
                        rows.setdefault(NAMES[k], []).append([rel(x.min()), rel(np.median(x)), rel(x.max())])
                    x = cur[:, :nd, 7]
                    x = x[x > -ref]  # (only the publishing block writes it: unwritten entries read 0 - ref)
                    rows.setdefault(NAMES[7], []).append([rel(x.min()), rel(np.median(x)), rel(x.max())])
                    for k in range(8, 13):
                        x = cur[:, :nc, k]
                        x = x[x > -ref] if k == 11 else x
                        rows.setdefault(NAMES[k], []).append([rel(x.min()), rel(np.median(x)), rel(x.max())])
                print(f"{'stamp':12s} {'min':>7s} {'median':>7s} {'max':>7s}   (us from the first d.gdwait; medians over replays)")
                for k, v in rows.items():
                    m = np.median(np.array(v), axis=0)
                    print(f"{k:12s} {m[0]:7.2f} {m[1]:7.2f} {m[2]:7.2f}")
        finally:
            b.close()


main()
