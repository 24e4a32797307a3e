"""fastdiag.attach(all_reduce=True) under DDP on a real gloo group: every rank records the
statistics of the whole global batch."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastdiag
from fastdiag.testing import NanoGPT, free_port


def _model():
    torch.manual_seed(0)
    return NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)


def _batch():
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(5))


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        with fastdiag.attach(ddp, every=1, all_reduce=True) as monitor:
            ddp(_batch()[rank * 2:(rank + 1) * 2]).square().mean().backward()
        out[rank] = {name: (s.gram, s.entropy_sum, s.rows) for name, s in monitor.latest_stats().items()}
    finally:
        dist.destroy_process_group()


def test_all_reduce_gives_every_rank_the_global_statistics():
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    model = _model()
    with fastdiag.attach(model, every=1) as monitor:
        model(_batch())  # the whole global batch in one process
    want = monitor.latest_stats()
    for rank in range(2):
        assert sorted(out[rank]) == ["module.blocks.0", "module.blocks.1"]
        for name, (gram, entropy_sum, rows) in out[rank].items():
            ref = want[name.removeprefix("module.")]
            torch.testing.assert_close(gram, ref.gram, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(entropy_sum, ref.entropy_sum, rtol=1e-5, atol=1e-6)
            assert torch.equal(rows, ref.rows)
