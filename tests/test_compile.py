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
