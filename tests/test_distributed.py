"""HeadStats.all_reduce over a real gloo group: every rank gets the statistics of all the data."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastdiag
from fastdiag.testing import free_port, random_probs


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        probs = random_probs((6, 3, 5, 5), seed=9)
        local = fastdiag.head_stats(probs[rank * 3:(rank + 1) * 3], backend="torch")
        reduced = local.all_reduce()
        out[rank] = torch.stack([reduced.sync(), reduced.entropy_spread()])
    finally:
        dist.destroy_process_group()


def test_all_reduce_equals_global_statistics():
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    whole = fastdiag.head_stats(random_probs((6, 3, 5, 5), seed=9), backend="reference")
    want = torch.stack([whole.sync(), whole.entropy_spread()])
    for rank in range(2):
        torch.testing.assert_close(out[rank], want, rtol=1e-5, atol=1e-7)
