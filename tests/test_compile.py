"""The diagnostics inside compiled graphs: fullgraph, same numbers as eager."""
import torch

import fastdiag
from fastdiag.core.kernels.head_stats_triton import head_stats_op
from fastdiag.testing import random_probs, random_query_mask


def _layer_step(q, k, mask):
    probs = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    s = fastdiag.head_stats(probs, mask)
    return s.sync(), s.entropy_spread()


def test_head_stats_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 4, 9, 8, generator=g)
    mask = random_query_mask((2, 9))
    compiled = torch.compile(_layer_step, fullgraph=True)
    for got, want in zip(compiled(q, k, mask), _layer_step(q, k, mask)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_library_op_compiles_fullgraph_on_cpu():
    """The torch.library op (CUDA: the Triton kernel) is one opaque node; on CPU it runs the torch path."""
    torch._dynamo.reset()
    probs = random_probs((1, 3, 4, 6, 6), seed=4)
    mask = random_query_mask((1, 3, 6), seed=4)
    compiled = torch.compile(lambda p, m: head_stats_op(p, m), fullgraph=True)
    got = compiled(probs, mask)
    want = fastdiag.head_stats(probs, mask, backend="reference")
    torch.testing.assert_close(got[0].double(), want.gram, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1].double(), want.entropy_sum, rtol=1e-5, atol=1e-6)


def test_library_op_passes_opcheck():
    probs = random_probs((2, 2, 3, 5, 5), seed=5)
    mask = random_query_mask((2, 2, 5), seed=5)
    torch.library.opcheck(head_stats_op, (probs, mask), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(head_stats_op, (probs, None), test_utils=("test_schema", "test_faketensor"))


def test_kernel_lookup_is_traceable_inside_a_compiled_graph():
    """The Triton dispatcher finds its kernel module inside a fullgraph trace, first import included
    (a fresh interpreter: `importlib.import_module` is refused by dynamo, which broke
    `torch.compile(fullgraph=True)` of head_stats on a GPU)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from fastdiag.core.diagnostics import kernel_module_named\n"
            "assert 'fastdiag.core.kernels.qk_stats_triton' not in sys.modules\n"
            "fn = torch.compile(lambda x: x + kernel_module_named('qk_stats_triton').LOG2E, fullgraph=True,"
            " backend='eager')\n"
            "print(float(fn(torch.zeros(1))[0]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert abs(float(done.stdout.split()[-1]) - 1.4426950408889634) < 1e-6


def test_references_keep_to_the_inputs_device():
    """The float64 references build every mask on the inputs' device (the causal mask of the Q/K
    reference was built on the CPU, which failed for CUDA inputs): checked on the meta device."""
    from fastdiag.core.kernels.qk_stats_ref import visible_keys_ref

    q = torch.empty(2, 4, 8, 16, device="meta")
    assert visible_keys_ref(None, True, (2, 4, 8, 8), q.device).device.type == "meta"
    mask = torch.ones(8, 8, dtype=torch.bool, device="meta")
    assert visible_keys_ref(mask, True, (2, 4, 8, 8)).device.type == "meta"
