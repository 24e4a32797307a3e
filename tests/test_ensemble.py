"""Vectorised ensembles: each member follows its single run; finished members are compacted away."""
import dataclasses

import pytest
import torch

from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import default_ensemble_size, pack_runs, train_ensemble
from fastdiag.models import build
from fastdiag.models.ensemble import stack_models
from fastdiag.grokking.train import train_run

from tests.helpers import assert_ensemble_adamw_is_torchs_per_member

SMALL = dict(preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, p=31, train_frac=0.7,
             lr=3e-3, batch_size=128, eval_every=10, epochs=300, device="cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["transformer", "mlp", "mamba"])
def test_stacked_forward_equals_each_member(arch):
    kwargs = {"transformer": dict(preset="custom", n_layers=2, n_heads=4, d_model=32, d_ff=64),
              "mlp": dict(hidden=64), "mamba": dict(d_model=16, n_layers=2)}[arch]
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build(arch, vocab_size=32, **kwargs))
    ensemble = stack_models(arch, models)
    idx = torch.randint(0, 32, (3, 10, 3))
    out = ensemble(idx)
    for k, m in enumerate(models):
        torch.testing.assert_close(out[k], m(idx[k]), rtol=1e-5, atol=1e-5)
        assert all(torch.equal(v, dict(m.named_parameters())[n]) for n, v in ensemble.member_state_dict(k).items())


def test_a_monitor_measures_each_member_of_an_ensemble_as_its_single_model():
    """`fastdiag.attach` on a vectorised transformer (the ensemble trainer's path): one record per
    measured step, every layer with the members leading, each value a list over the members."""
    import fastdiag

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build("transformer", vocab_size=32, preset="custom", n_layers=2, n_heads=4, d_model=32, d_ff=64))
    idx = torch.randint(0, 32, (3, 10, 3))
    singles = [fastdiag.attach(m, every=1) for m in models]
    for k, m in enumerate(models):
        m(idx[k])
    with fastdiag.attach(stack_models("transformer", models), every=1) as monitor:
        monitor.model(idx)
        assert list(monitor.merged_stats()) == ["blocks.0.attn", "blocks.1.attn"]
        row = monitor.latest()
    for k, single in enumerate(singles):
        want = single.latest()
        for key in ("s_bar", "sigma_h", "sync/blocks.1.attn", "spread/blocks.0.attn"):
            assert row[key][k] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        single.detach()


def test_ensemble_adamw_matches_torch_adamw_per_member():
    assert_ensemble_adamw_is_torchs_per_member()


def _diagnostic(key: str) -> bool:
    return "s_bar" in key or "sigma_h" in key or key.startswith(("sync/", "spread/"))


def test_members_are_their_single_runs_bit_for_bit_and_finished_members_are_dropped(small_grok_runs, one_thread):
    """At one thread a packed member does its single run's arithmetic op for op (each member's rows
    through the same linear, layer-norm and SDPA kernels, the same AdamW), so its training is the single
    run's to the last bit: every loss, accuracy and weight norm of the trace, t_grok, the regime. The
    head diagnostics agree to float32 rounding only: `head_stats` chunks the members' probabilities
    together, in another summation order, and they never feed back into training.

    Before the shared layer norm (`fastdiag.models.norm`) the fused layer-norm backward summed the
    gradients of its weight and bias in another order than the ensemble's: 1e-9 apart after one step,
    and training is chaotic, so the two stopped up to two evaluations apart."""
    singles = small_grok_runs
    ensemble = train_ensemble([s.config for s in singles])
    for single, member in zip(singles, ensemble):
        assert [list(r) for r in member.trace] == [list(r) for r in single.trace]
        for a, b in zip(member.trace, single.trace):
            for key in a:
                if _diagnostic(key):
                    assert a[key] == pytest.approx(b[key], rel=1e-6), (a["epoch"], key)
                else:
                    assert a[key] == b[key], (a["epoch"], key)
        assert set(member.result) - {"ensemble_size"} == set(single.result)
        for key, value in single.result.items():
            if _diagnostic(key):
                assert member.result[key] == pytest.approx(value, rel=1e-6), key
            elif key != "wall_seconds":
                assert member.result[key] == value, key
    # λ = 1 grokked and stopped early while the λ = 0 member trained on to the horizon
    assert ensemble[0].result["regime"] == "grok"
    assert ensemble[0].result["epochs_run"] < ensemble[1].result["epochs_run"] == singles[1].config.epochs


MAMBA = dict(arch="mamba", d_model=32, n_layers=2, p=31, train_frac=0.7, lr=4e-3, batch_size=128, eval_every=10,
             epochs=90, device="cpu")


@pytest.mark.slow
def test_mamba_members_follow_their_single_runs():
    """The PyTorch Mamba packs like the others, but not bit for bit: the stacked selective scan and
    depthwise convolution sum in another order than the single model's. Measured at one thread
    (λ = 1 seed 0 and λ = 0 seed 2, evaluations every 10 epochs): at lr 3e-3 the members' train
    losses are within 3.5e-7 (relative) of their single runs' to epoch 60, then the λ = 1 run's grokking
    transition amplifies the difference about tenfold per evaluation (9e-6 at 70, 5e-4 at 100, 3e-2
    in its loss spike at 110) while every accuracy stays identical and both grok at epoch 120. Here at
    lr 4e-3 (two thirds of the training): losses within 7.8e-7 to epoch 40 (1.3e-7 to 30), 1e-6 to 4e-6
    from 50 on as the transition starts, every accuracy identical, both grok at epoch 80. So: losses
    within 1e-5 to epoch 40 (13x the measured gap), the same regime, t_grok and trace length within
    one evaluation (the transition may shift by one evaluation on other hardware)."""
    cfgs = [RunConfig(seed=0, weight_decay=1.0, **MAMBA), RunConfig(seed=2, weight_decay=0.0, **MAMBA)]
    ensemble = train_ensemble(cfgs)
    for cfg, member in zip(cfgs, ensemble):
        single = train_run(cfg)
        assert member.result["run_id"] == single.result["run_id"] and member.result["ensemble_size"] == 2
        assert abs(len(member.trace) - len(single.trace)) <= 1
        early = [(a, b) for a, b in zip(member.trace, single.trace) if a["epoch"] <= 40]
        assert len(early) == 4
        for a, b in early:
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5), a["epoch"]
            assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5), a["epoch"]
        assert member.result["regime"] == single.result["regime"]
        if single.result["t_grok_epoch"] is not None:
            assert abs(member.result["t_grok_epoch"] - single.result["t_grok_epoch"]) <= cfg.eval_every
    assert ensemble[0].result["regime"] == "grok" and ensemble[1].result["epochs_run"] == MAMBA["epochs"]


def test_mamba_stacked_gradients_equal_each_members():
    """One backward pass through the stacked Mamba gives every member its single model's gradient."""
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build("mamba", vocab_size=16, d_model=16, n_layers=2))
    ensemble = stack_models("mamba", models)
    idx, target = torch.randint(0, 16, (3, 9, 3)), torch.randint(0, 16, (3, 9))
    torch.nn.functional.cross_entropy(ensemble(idx).flatten(0, 1), target.flatten(), reduction="sum").backward()
    for k, m in enumerate(models):
        torch.nn.functional.cross_entropy(m(idx[k]), target[k], reduction="sum").backward()
        for name, p in m.named_parameters():
            torch.testing.assert_close(ensemble[name].grad[k], p.grad, rtol=1e-4, atol=1e-6)


def test_incompatible_or_unvectorisable_packs_are_refused():
    a = RunConfig(seed=0, **SMALL)
    with pytest.raises(ValueError, match="may differ only in seed, weight_decay"):
        train_ensemble([a, dataclasses.replace(a, seed=1, lr=1e-3)])
    lstm = RunConfig(arch="lstm", preset="canonical", seed=0, epochs=2, device="cpu")
    with pytest.raises(ValueError, match="'lstm' runs one by one here \\(lstm cannot be vectorised"):
        train_ensemble([lstm, dataclasses.replace(lstm, seed=1)])


def test_pack_runs_groups_compatible_runs_and_leaves_others_single():
    runs = [RunConfig(seed=s, weight_decay=wd, **SMALL) for s in range(3) for wd in (0.1, 1.0)]
    runs.append(RunConfig(arch="lstm", seed=0))
    runs.append(RunConfig(seed=0, **{**SMALL, "p": 23}))
    packs = pack_runs(runs, 4)
    assert sorted(len(p) for p in packs) == [1, 1, 3, 3]     # 6 compatible runs, K = 4: two packs of 3
    assert sorted(c.run_id() for p in packs for c in p) == sorted(c.run_id() for c in runs)
    assert all(len(p) == 1 for p in pack_runs(runs, 1))
    mambas = [RunConfig(arch="mamba", seed=s, device="cpu") for s in range(4)]
    assert [len(p) for p in pack_runs(mambas, 4)] == [4]                # the PyTorch Mamba packs too
    many = [RunConfig(seed=s, **SMALL) for s in range(17)]
    assert sorted(len(p) for p in pack_runs(many, 8)) == [5, 6, 6]     # balanced, not 8, 8, 1
    assert sorted(len(p) for p in pack_runs(many, None)) == [5, 6, 6]  # auto: 8 for this small model


def test_auto_ensemble_size_follows_device_and_model_size():
    assert default_ensemble_size(RunConfig(**SMALL)) == 8
    assert default_ensemble_size(RunConfig(device="cpu")) == 4             # canonical, 0.82 M
    assert default_ensemble_size(RunConfig(device="cpu", preset="19m")) == 1
    # CUDA: measured packs of 64-512 (tests/test_gpu_experiments.py)
