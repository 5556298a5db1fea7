"""The fused router's Python side without a GPU: which shapes the kernel takes (the layer's
fallback rule), the kernels in the cubin, host arrays refused before any device use, the
route op's CPU refusal, and the stage split placing the kernel in the router stage."""
import numpy as np
import pytest
from common import kernel_ptx

from ep_a2a import moe
from ep_a2a.tools.bench_layer_stages import OURS_MAP, kernel_class


@pytest.mark.parametrize("E,k,dtype,words", [
    (8, 1, "float32", None), (64, 8, "bfloat16", None), (256, 8, "float16", None), (1024, 32, "float32", None),
    (1, 1, "float32", None), (1025, 8, "float32", "num_experts=1025"), (0, 1, "float32", "num_experts=0"),
    (64, 33, "float32", "top_k=33"), (4, 5, "float32", "top_k=5"), (64, 0, "float32", "top_k=0"),
    (64, 8, "float64", "dtype float64"), (64, 8, "int32", "dtype int32"),
])
def test_route_unsupported_names_what_the_kernel_does_not_take(E, k, dtype, words):
    why = moe.route_unsupported(E, k, dtype)
    if words is None:
        assert why is None, why
    else:
        assert why is not None and words in why, why


def test_route_kernel_names_cover_every_dtype_and_width():
    assert len(moe.ROUTE_KERNELS) == len(set(moe.ROUTE_KERNELS)) == 3 * 6
    for n in (1, 2, 4, 8, 16, 32):
        assert 32 * n <= moe.ROUTE_MAX_EXPERTS
        for d in moe.ROUTE_DTYPES.values():
            assert f"moe_route_{d}_{n}" in moe.ROUTE_KERNELS


def test_cubins_have_the_route_kernels():
    from ep_a2a.driver import module
    built = module.built_cubins().get("moe_compute")
    if not built:
        pytest.skip("cubins not built (run `make cubins`)")
    for arch in built:
        data = (module.CUBIN_DIR / f"moe_compute.sm_{arch}.cubin").read_bytes()
        for name in moe.ROUTE_KERNELS:
            assert name.encode() in data, (arch, name)


def test_host_arrays_are_refused_naming_the_argument():
    rng = np.random.default_rng()
    with pytest.raises(ValueError, match="^logits: "):
        moe.route(rng.random((4, 8), dtype=np.float32), np.zeros((4, 2), np.int32), np.zeros((4, 2), np.float32))


def test_route_kernels_land_in_the_router_stage():
    """The graphed benchmark's stage split classifies kernels by name: every route kernel is
    the router stage of our layer, and nothing else of ours is taken for it."""
    for name in moe.ROUTE_KERNELS:
        assert kernel_class(name) == "route", name
        assert OURS_MAP[kernel_class(name)] == "router", name
    for other in ("moe_index_fused", "moe_gather_rows", "moe_swiglu_bf16", "moe_finalize_bf16_bf16",
                  "fence_dispatch", "sentinel_combine"):
        assert kernel_class(other) != "route", other


def test_route_op_refuses_cpu_tensors():
    torch = pytest.importorskip("torch")
    from ep_a2a.ops import torch as ops
    rng = np.random.default_rng()
    logits = torch.from_numpy(rng.random((3, 8), dtype=np.float32))
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    for call in (lambda: ops.route(logits, ids, w), lambda: ops.OPS["route"](logits, ids, w, False)):
        with pytest.raises(ValueError, match="^logits: must be on a CUDA GPU"):
            call()


def test_route_kernel_computes_the_weights_as_torch_does():
    """The weights follow torch's one-warp softmax only while the kernel is built as torch's
    kernels are: the accurate expf and an IEEE division (no fast math), the argmax on the
    warp's redux unit, and every per-lane array in registers (no local memory, at every
    width up to 32 logits a lane)."""
    import re
    ptx_text = kernel_ptx("moe_compute.cu")
    for name in moe.ROUTE_KERNELS:
        body = re.search(r"\.entry " + name + r"\((.*?)\n}", ptx_text, re.S)
        assert body, f"no {name} in the PTX"
        ptx = body.group(1)
        assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx, f"{name}: not an IEEE division"
        assert "redux.sync.max.u32" in ptx and "redux.sync.min.u32" in ptx, name
        assert ".local" not in ptx, f"{name}: a per-lane array went to local memory"
