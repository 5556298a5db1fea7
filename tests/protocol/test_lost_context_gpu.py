"""After a kernel trapped (on_timeout="trap"), the CUDA context of the process is lost: every
public call that reaches the driver must raise the PeerError a rank of the process recorded,
never a raw CudaError, also on a rank whose own record is empty and whose first driver call
is the host expert-id check's copy (validate_expert_ids=True). In a child process: the trap
takes the context with it."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import json, time
    import numpy as np
    import ep_a2a
    from ep_a2a.interop.arrays import from_numpy
    from ep_a2a.testing.formats import payload_formats, random_payload
    PROTOCOL = {protocol!r}
    rng = np.random.default_rng()
    g = ep_a2a.LocalGroup([0, 0, 0])
    a = ep_a2a.MoeAlltoAll(g, max_tokens_per_rank=16, top_k=4, num_experts=12, payloads=payload_formats(96, 4)["mxfp8"],
                           combine_hidden_size=96, protocol=PROTOCOL, timeout_s=0.5, first_timeout_s=0.5,
                           on_timeout="trap", validate_expert_ids=True)
    def inputs(r, T=4):
        ids = from_numpy(rng.integers(0, 12, (T, 4)).astype(np.int32), r.device, "int32")
        return ids, [from_numpy(random_payload(rng, sp, T), r.device, sp.dtype) for sp in a.payload_specs]
    r0, r1, r2 = a.ranks
    ins = [inputs(r) for r in a.ranks]
    r0.dispatch(*ins[0], 4)
    r1.dispatch(*ins[1], 4)   # rank 2 never arrives: ranks 0 and 1 time out and trap
    time.sleep(3.0)
    calls = {{
        "r2.dispatch (host id check first)": lambda: r2.dispatch(*ins[2], 4),
        "r2.synchronize": r2.synchronize,
        "r2.dropped_selections": r2.dropped_selections,
        "r0.combine": lambda: r0.combine(r0.combine_input(4), 4),
        "r0.synchronize": r0.synchronize,
        "a.synchronize": a.synchronize,
        "a.check_errors": a.check_errors,
    }}
    out = {{}}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except BaseException as e:
            out[name] = type(e).__name__ + ": " + str(e)
    print("RESULT " + json.dumps(out), flush=True)
    import os; os._exit(0)   # (closing on a lost context is not the point here)
""")


@pytest.mark.parametrize("protocol", ["fence", "sentinel"])
def test_every_call_after_a_lost_context_raises_the_recorded_peer_error(protocol):
    p = subprocess.run([sys.executable, "-c", CHILD.format(protocol=protocol)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, p.stdout[-2000:] + p.stderr[-2000:]
    results = json.loads(line[len("RESULT "):])
    wrong = {k: v for k, v in results.items() if not v.startswith("PeerTimeoutError")}
    assert not wrong, wrong
