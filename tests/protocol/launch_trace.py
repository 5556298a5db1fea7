"""A recorded sweep of dispatch/combine calls on one rank without a GPU: every launch's
kernel, cluster shape, grid, stream and parameter-block bytes, every staging copy and memset,
every returned view. test_launch_golden_cpu compares it with the trace of 05ee552 kept in
golden/launches-05ee552.json, so that a change of the host side that claims to keep the
behaviour can prove it byte for byte.

Run as a script to rewrite the golden file (only from the code whose behaviour it records):
    PYTHONPATH=. .venv/bin/python tests/protocol/launch_trace.py
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import pathlib
import sys
import types

import ep_a2a.alltoall as A
import ep_a2a.driver.launch as launch_module
import ep_a2a.interop.tensor as tensor_module
from ep_a2a import schedule
from ep_a2a.config import Options, PayloadSpec
from ep_a2a.interop.tensor import Tensor
from ep_a2a.testing import hooks
from ep_a2a.layout import A2AParams, WorkspaceLayout, landing_bytes

GOLDEN = pathlib.Path(__file__).with_name("golden") / "launches-05ee552.json"
EP, TOP_K, H, MAX_TOKENS = 8, 8, 7168, 1024
BASE, PEER_STRIDE, RECORD = 1 << 40, 1 << 36, 1 << 45
SWEEP_TOKENS = ((1, (0, 1)), (16, (1, 16)), (128, (16, 128)), (1024, (0, 1024)))  # (T^, Ts)

# A2AParams as 05ee552 had it: the fields appended since (the host's decisions the kernels
# once derived) are checked against 05ee552's kernel rules by test_launch_golden_cpu
PARAM_BYTES_05EE552 = 1168
FIELDS = ("step_tag", "local_num_tokens", "runtime_max_tokens_per_rank", "trigger_early", "dispatch_splits",
          "combine_splits", "combine_vec", "combine_prequantized", "timeout_ns")


class _HostMapped:
    def __init__(self, n, dev):
        self.buf = ctypes.create_string_buffer(n)
        self.host_ptr, self.device_ptr = ctypes.addressof(self.buf), RECORD

    def close(self):
        pass


class _Module:
    def function(self, name):
        return name


def _cluster_of(launch) -> int:
    for attr in (launch.config.attrs or ()) if launch.config.numAttrs else ():
        if int(attr.id) == int(launch_module._drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION):
            return int(attr.value.clusterDim.x)
    return 1


def _recorder(events):
    """What dry_run calls at each skipped launch: its parameter block as it is then."""
    def record(launch, stream):
        if not isinstance(launch.args[0], A2AParams):  # (a construction fill: dropped by make_rank)
            events.append(["launch", str(launch.function), launch.grid, stream])
            return
        p = A2AParams.from_buffer_copy(bytes(launch.args[0]))
        events.append(["launch", str(launch.function), _cluster_of(launch), launch.grid, stream,
                       hashlib.sha256(bytes(launch.args[0])[:PARAM_BYTES_05EE552]).hexdigest()[:24],
                       [int(getattr(p, f)) for f in FIELDS]])
    return record


def patch_driver(setattr_, events):
    """Replace the driver calls a rank makes by recorders, in every ep_a2a module that names them."""
    fakes = {
        "HostMapped": _HostMapped,
        "load": lambda name, dev: _Module(),
        "occupancy": lambda f, t: 4,
        "prefer_max_shared": lambda f: f,
        "cluster_launch": lambda dev, fn, args, cluster, block, pdl, at_once:
            launch_module.Launch(dev, fn, args, cluster, block, pdl=pdl, cluster=cluster),
        "DeviceAllocation": lambda dev, n: types.SimpleNamespace(ptr=1 << 32, close=lambda: None),
        "copy_dtod_async": lambda *args: events.append(["copy", *args]),
        "memset_d8_async": lambda *args: events.append(["memset", *args]),
        "synchronize_stream": lambda handle: None,
        "SymmetricWorkspace": lambda group, nbytes: _Workspace(),
    }
    for name, module in list(sys.modules.items()):
        if name.startswith("ep_a2a") and module is not None and name != "ep_a2a.driver.launch":
            for attr, fake in fakes.items():
                if hasattr(module, attr):
                    setattr_(module, attr, fake)
    setattr_(tensor_module, "_wait", lambda consumer, producer, dev: events.append(["wait", consumer, producer]))


def _specs():
    return (PayloadSpec("hidden", (H,), "bfloat16"), PayloadSpec("scales", (H // 128,), "float32"),
            PayloadSpec("weights", (TOP_K,), "float32"))


class _Workspace:
    """SymmetricWorkspace's addresses, at fixed values (so that runs compare bytes)."""
    size = 1 << 30

    def base(self, i):
        return BASE

    def peers(self, i):
        return [BASE + PEER_STRIDE * q for q in range(EP)]

    def close(self):
        pass


def make_rank(events, protocol, combine_quant, pdl, ranks_on_device, local):
    """A MoeAlltoAll of EP ranks of which this process holds one (rank 3, or the last of fewer),
    built as on a GPU with the driver replaced (patch_driver); what its construction launched
    is dropped."""
    dev = types.SimpleNamespace(ordinal=0, sm_count=132, compute_capability=(9, 0), make_current=lambda: None,
                                synchronize=lambda: None)
    rank = types.SimpleNamespace(rank=min(3, EP - 1), device=dev, stream=types.SimpleNamespace(handle=7, synchronize=lambda: None),
                                 ranks_on_device=ranks_on_device)
    group = types.SimpleNamespace(ep_size=EP, is_local=local, ranks=[rank], agree=lambda values, what: None,
                                  bootstrap=types.SimpleNamespace(barrier=lambda: None))
    n = len(events)
    a2a = A.MoeAlltoAll(group, max_tokens_per_rank=MAX_TOKENS, top_k=TOP_K, num_experts=256, payloads=_specs(),
                        combine_hidden_size=H, combine_dtype="bfloat16", protocol=protocol, timeout_s=10,
                        first_timeout_s=60, validate_expert_ids=False, pdl=pdl, threads_per_block=256,
                        crossover_tokens=16, on_timeout="trap", combine_quant=combine_quant)
    del events[n:]
    return a2a, a2a.ranks[0]


def _tensors(tag, T, odd=0):
    ids = Tensor((1 << 33) + (tag << 20), (T, TOP_K), "int32", device=(2, 0))
    pays = [Tensor((1 << 34) + (tag << 24) + (k << 22) + odd, (T,) + s.shape, s.dtype, device=(2, 0))
            for k, s in enumerate(_specs())]
    return ids, pays


def run_config(events, protocol, combine_quant, pdl, ranks_on_device):
    """The call sequence of one configuration; every call's results go into `events`."""
    a2a, r = make_rank(events, protocol, combine_quant, pdl, ranks_on_device, local=True)
    outs = {}

    def step(tag, T, tmax, stream=None, part="cin", out=None, odd=0, dispatch_only=False):
        ids, pays = tensors.setdefault((tag, T, odd), _tensors(tag, T, odd))
        ids_v, views = r.dispatch(ids, pays, tmax, stream=stream)
        events.append(["views", ids_v.ptr, list(ids_v.shape), ids_v.stream, [v.ptr for v in views]])
        if dispatch_only:
            hooks.abandon_dispatch(r)
            return
        if part == "cin":
            partial = r.combine_input(tmax)
        elif part == "fp8":
            partial = r.combine_input(tmax, fp8=True)
        else:
            partial = outs.setdefault(("part", tmax), Tensor(1 << 38, (EP, tmax, H), "bfloat16", device=(2, 0)))
        o = None if out is None else outs.setdefault(("out", T, out), Tensor((1 << 39) + out, (T, H), "bfloat16",
                                                                            device=(2, 0)))
        y = r.combine(partial, tmax, stream=stream, out=o)
        events.append(["out", y.ptr, list(y.shape), y.stream])
    tensors = {}
    for tmax, Ts in SWEEP_TOKENS:
        for T in Ts:
            events.append(["config", protocol, combine_quant, pdl, ranks_on_device, T, tmax])
            for _ in range(3):
                step(0, T, tmax)
            step(0, T, tmax, stream=9)
            step(1, T, tmax, part="staged")
            step(1, T, tmax, out=0)
            step(1, T, tmax, out=2)
            step(2, T, tmax, odd=4)
            if combine_quant:
                step(0, T, tmax, part="fp8")
                step(0, T, tmax)
            if schedule.protocol_for(protocol, tmax, a2a.crossover_tokens) == "fence":
                step(0, T, tmax, dispatch_only=True)
            for _ in range(3):
                step(0, T, tmax)
    events.append(["active"])
    a2a.set_active_ranks(range(1, EP))
    for tmax, Ts in SWEEP_TOKENS[:2]:
        for _ in range(2):
            step(0, Ts[-1], tmax)
    # a rank alone in its process that rejects its input runs the step without tokens
    events.append(["reject"])
    a2a2, r2 = make_rank(events, protocol, combine_quant, pdl, ranks_on_device, local=False)
    ids, pays = _tensors(0, 4)
    for _ in range(6):
        r2.dispatch(ids, pays, 16)
        r2.combine(r2.combine_input(16), 16)
    bad = [Tensor(p.ptr, p.shape, "float16" if p.dtype.name == "bfloat16" else p.dtype, device=(2, 0)) for p in pays]
    try:
        r2.dispatch(ids, bad, 16)
    except TypeError as e:
        events.append(["rejected", type(e).__name__])
    a2a.close()
    a2a2.close()


CONFIGS = [(proto, q, pdl, rod) for proto in ("fence", "sentinel", "auto") for q in (None, "fp8")
           for pdl in (True, False) for rod in (8, 1) if not (q and proto != "fence")]


def trace(setattr_) -> list:
    """The events of every configuration, launches skipped by testing.hooks.dry_run."""
    events = []
    patch_driver(setattr_, events)
    with hooks.dry_run(_recorder(events)):
        for cfg in CONFIGS:
            run_config(events, *cfg)
    return json.loads(json.dumps(events))  # (tuples as lists, as the file holds them)


if __name__ == "__main__":
    saved = []
    try:
        events = trace(lambda m, k, v: (saved.append((m, k, getattr(m, k))), setattr(m, k, v)))
    finally:
        for m, k, v in reversed(saved):
            setattr(m, k, v)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(events, separators=(",", ":")).replace("],[", "],\n["))
    print(f"{len(events)} events, {sum(e[0] == 'launch' for e in events)} launches -> {GOLDEN}")
