"""Device tests of the experiment stack on CUDA (benchmarks/gpu_check.sh runs them on a lent GPU;
skipped elsewhere): the Triton Mamba scan in a model, graphed training steps against eager ones, the
measured ensemble size, the dry run's calibration."""
import dataclasses
import warnings

import pytest
import torch

import fastdiag.models.mamba as mamba
from fastdiag.grokking.build import build_model
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import gpu_ensemble_choice, gpu_ensemble_size, train_ensemble
from fastdiag.grokking.train import Trainer, train_run
from fastdiag.sweep.plan import estimate_sweep

from tests.helpers import assert_ensemble_adamw_is_torchs_per_member

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = dict(preset="custom", n_layers=2, n_heads=4, d_model=32, d_ff=64, p=23, train_frac=0.6,
             batch_size=64, epochs=4, eval_every=1, diag_every=3, device="cuda")
# graphed and eager CUDA runs differ only in AdamW's bias corrections (float32 on the device against
# float64 on the host, ~1e-7 relative per step): over a few epochs the traces agree to this
TRACE_RTOL = 1e-4


def _close_traces(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for key, va in ra.items():
            if key == "wall_seconds" or not isinstance(va, float):
                assert va == rb[key] or key == "wall_seconds", key
                continue
            assert va == pytest.approx(rb[key], rel=TRACE_RTOL, abs=1e-6), (ra["epoch"], key)


def test_mamba_on_cuda_without_mamba_ssm_runs_the_triton_scan():
    if mamba.mamba_ssm_available():
        pytest.skip("mamba-ssm's kernels are installed here: they run instead")
    cfg = RunConfig(arch="mamba", d_model=32, n_layers=2, p=23)
    torch.manual_seed(0)
    cpu = build_model(dataclasses.replace(cfg, device="cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # "using fastdiag's Triton selective scan"
        gpu = build_model(dataclasses.replace(cfg, device="cuda"), device="cuda").cuda()
    gpu.load_state_dict(cpu.state_dict())
    assert mamba._scan_function(torch.zeros(1, device="cuda")).__name__ == "TritonSelectiveScan"
    idx = torch.randint(0, 24, (64, 3))
    out_cpu, out_gpu = cpu(idx), gpu(idx.cuda())
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
    out_cpu.square().sum().backward()
    out_gpu.square().sum().backward()
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["transformer", "mamba"])
def test_graphed_run_is_the_eager_run(arch):
    """The same run graphed (default on CUDA) and eager: traces within TRACE_RTOL, and the graphed one
    replayed both step shapes (full and tail minibatch) measured and not."""
    cfg = RunConfig(**SMALL) if arch == "transformer" else RunConfig(arch="mamba", d_model=32, n_layers=2,
                                                                         **{k: v for k, v in SMALL.items() if k not in (
                                                                             "preset", "n_layers", "n_heads", "d_model", "d_ff")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        graphed = Trainer(cfg)
        while not graphed.done:
            graphed.run_epoch()
        eager = train_run(dataclasses.replace(cfg, graphed=False))
    assert graphed.graphs is not None and not graphed.graphs._failed, graphed.graphs._failed
    if arch == "transformer":
        assert {measured for _, measured in graphed.graphs.captured} == {True, False}
    _close_traces(graphed.outcome().trace, eager.trace)


def test_graphed_steps_read_nothing_back_between_evaluations():
    cfg = RunConfig(**SMALL)
    trainer = Trainer(cfg)
    trainer.run_epoch()
    trainer.run_epoch()                                     # every step shape captured by now
    idx = torch.arange(cfg.batch_size, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2 * cfg.diag_every):
            trainer._train_step(idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(trainer.graphs.captured) >= 2


def test_graphed_ensemble_is_the_eager_ensemble():
    cfgs = [RunConfig(**SMALL, seed=s, weight_decay=w) for s, w in ((0, 1.0), (1, 0.3), (2, 0.1))]
    graphed = train_ensemble(cfgs)
    eager = train_ensemble([dataclasses.replace(c, graphed=False) for c in cfgs])
    for g, e in zip(graphed, eager):
        _close_traces(g.trace, e.trace)


def test_ensemble_auto_on_cuda_measures_packs_of_64_and_up():
    cfg = RunConfig(device="cuda")
    size = gpu_ensemble_size(cfg, sizes=(64, 128), steps=5)
    choice = gpu_ensemble_choice(cfg, sizes=(64, 128))
    assert size in (64, 128) and choice["size"] == size
    assert set(choice["member_steps_per_second"]) == {64, 128} and choice["bytes_per_member"] > 0


def test_dry_run_estimate_is_calibrated_on_the_gpu():
    configs = [RunConfig(**SMALL, weight_decay=w, seed=s) for w in (0.3, 1.0) for s in range(4)]
    est = estimate_sweep(configs, ensemble=None, steps=20)
    assert est["device"].startswith("cuda") and est["workers"] == torch.cuda.device_count()
    assert all(m["device"].startswith("cuda") and m["peak_bytes"] > 0 for m in est["measured"])
    assert est["seconds"] > 0


def test_ensemble_capturable_adamw_is_torchs_per_member():
    """The graphed ensemble's AdamW (capturable, foreach) against torch.optim.AdamW(capturable=True,
    foreach=True) on each member, as the graphed single runs use it."""
    assert_ensemble_adamw_is_torchs_per_member("cuda", capturable=True)
