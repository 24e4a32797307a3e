"""No measured step makes the host wait for the device: the ops that would (item, nonzero, boolean
indexing, ...) are found by `fastdiag.core.host_sync.SyncDetector` on CPU, on every backend."""
import pytest
import torch

import fastdiag
from fastdiag.core.host_sync import SyncDetector
from fastdiag.testing import NanoGPT
from tests.helpers import tiny_hf

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("op", [
    lambda t: t.sum().item(), lambda t: bool(t.sum() > 0), lambda t: t.nonzero(), lambda t: t[t > 0],
    lambda t: t.masked_select(t > 0), lambda t: torch.unique(t), lambda t: t.flatten().argwhere(),
    lambda t: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0])),
    lambda t: t.__setitem__(t > 0, 0.0)], ids=["item", "bool", "nonzero", "bool-index", "masked_select",
                                              "unique", "argwhere", "repeat_interleave", "bool-index-put"])
def test_detector_names_each_sync(op):
    with SyncDetector() as seen:
        op(torch.randn(4, 5))
    assert seen.ops


def test_detector_lets_sync_free_ops_pass():
    t = torch.randn(4, 5)
    with SyncDetector() as seen:
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0]), output_size=3)
        t.masked_fill(t > 0, 0.0).softmax(-1).sum(0)
        t[torch.tensor([0, 2])]
    assert seen.ops == []


def test_detector_raises_when_asked():
    with pytest.raises(RuntimeError, match="host sync"), SyncDetector(raise_on_sync=True):
        torch.randn(3).sum().item()


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("family,attn,padded", [("gpt2", "sdpa", False), ("llama", "sdpa", True),
                                                ("gpt2", "eager", True), ("nanogpt", "sdpa", False)])
def test_measured_steps_never_sync(family, attn, padded, backend):
    """The careful first measured pass and the ones after it, with and without padding: no sync
    beyond the model's own."""
    if family == "nanogpt":
        torch.manual_seed(0)
        model = NanoGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
        step = lambda: model(torch.randint(0, 64, (2, 16))).square().mean().backward()  # noqa: E731
    else:
        model = tiny_hf(family, attn)
        ids = torch.randint(0, 64, (2, 12))
        mask = torch.ones(2, 12, dtype=torch.long)
        if padded:
            mask[1, :3] = 0
        step = lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()  # noqa: E731
    with SyncDetector() as bare:      # the model's own (HF reads its attention_mask on the host)
        step()
    monitor = fastdiag.attach(model, every=1, backend=backend)
    try:
        for _ in range(3):
            with SyncDetector() as seen:
                step()
            # the PyTorch head_stats path reads values on the host on CPU tensors only (`read_data`: a
            # zero check that is free there); its CUDA path, like everything else, reads none
            cpu_only = [w for w in seen.where if "kernels/head_stats_torch.py" in w] if backend == "torch" else []
            assert len(seen.ops) - len(cpu_only) == len(bare.ops), list(zip(seen.ops, seen.where))
        assert monitor.latest()["s_bar"] == monitor.latest()["s_bar"]   # measured: not NaN (read after)
    finally:
        monitor.detach()
