"""Graphed training steps (`fastdiag.grokking.graphed_step`): on a CPU nothing changes; the config field,
its flag and the run identity. The CUDA paths themselves: tests/test_gpu_experiments.py (device tests)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import fastdiag
from fastdiag.cli import cli
from fastdiag.grokking.build import build_model
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import EnsembleAdamW
from fastdiag.grokking.graphed_step import graphed_device, make_adamw
from fastdiag.grokking.tasks import make_task
from fastdiag.grokking.train import Trainer, train_run

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=16, d_ff=32, p=7, train_frac=0.6,
            batch_size=8, epochs=3, eval_every=1, diag_every=2, device="cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_graphs_only_on_cuda():
    assert graphed_device(True, torch.device("cuda")) and graphed_device(True, "cuda:1")
    assert not graphed_device(True, torch.device("cpu")) and not graphed_device(False, "cuda")
    trainer = Trainer(RunConfig(**TINY, graphed=True))
    assert trainer.graphs is None
    plain = torch.optim.AdamW([torch.zeros(1)], lr=1e-3, betas=(0.9, 0.98), weight_decay=1.0).defaults
    assert trainer.opt.defaults == plain                  # the CPU optimizer is PyTorch's default AdamW
    assert make_adamw([torch.zeros(1)], 1e-3, 1.0, graphed=True).defaults["capturable"]


def test_cpu_trace_is_the_plain_pytorch_loop_whatever_the_flag():
    """graphed on and off train the same run on a CPU (traces equal to the last bit), and its weights
    are those of a bare PyTorch loop of the same setup, measured by fastdiag.attach as the trainer's
    is: the CPU trainer's arithmetic is unchanged."""
    runs = [train_run(RunConfig(**TINY, seed=3, graphed=g)) for g in (True, False)]
    drop = lambda row: {k: v for k, v in row.items() if k != "wall_seconds"}   # noqa: E731
    assert [drop(r) for r in runs[0].trace] == [drop(r) for r in runs[1].trace]
    assert runs[0].result["regime"] == runs[1].result["regime"]

    cfg = RunConfig(**TINY, seed=3)
    trainer = Trainer(cfg)
    for _ in range(cfg.epochs):
        trainer.run_epoch()
    task = make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    monitor = fastdiag.attach(model, every=cfg.diag_every, keep_records=False)   # measured passes as the trainer's
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.epochs):
        perm = torch.randperm(task.train_x.shape[0], generator=shuffle)
        for start in range(0, perm.shape[0], cfg.batch_size):
            idx = perm[start:start + cfg.batch_size]
            loss = F.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for (name, want), got in zip(model.named_parameters(), trainer.model.parameters()):
        assert torch.equal(got, want), name
    monitor.detach()


def test_graphed_is_how_not_what_a_run_computes():
    """The flag leaves the run's identity alone (stores made before it keep their ids and resume),
    and a stored config without it is valid and takes the default."""
    on, off = RunConfig(graphed=True), RunConfig(graphed=False)
    assert on.run_id() == off.run_id() == RunConfig().run_id()
    stored = RunConfig().to_dict()
    del stored["graphed"]
    RunConfig.check_stored(stored)
    assert RunConfig.from_dict(stored).graphed is True
    with pytest.raises(ValueError, match="graphed is 'yes', expected bool"):
        RunConfig.check_stored({**stored, "graphed": "yes"})


def test_graphed_flag_is_generated_for_every_training_command(tmp_path):
    runner = CliRunner()
    for command in ("run", "sweep"):
        out = runner.invoke(cli, [command, "--help"]).output
        assert "--graphed / --no-graphed" in out, command
    done = runner.invoke(cli, ["sweep", "--wd", "1", "--no-graphed", "--dry-run", "--calibrate-steps", "0",
                               "--store", str(tmp_path / "graphed.sqlite")])
    assert done.exit_code == 0 and "1 runs" in done.output, done.output


def test_ensemble_adamw_capturable_form_is_the_same_update():
    """The capturable form (device-side step counter, torch's capturable arithmetic) on CPU tensors:
    the eager form's update to float32 rounding, and its step count read back."""
    torch.manual_seed(0)
    start = torch.randn(3, 5, 4)
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    eager = EnsembleAdamW([a], lr=1e-2, weight_decay=[0.0, 0.3, 2.0])
    graphable = EnsembleAdamW([b], lr=1e-2, weight_decay=[0.0, 0.3, 2.0], capturable=True)
    for _ in range(6):
        g = torch.randn(3, 5, 4)
        a.grad, b.grad = g.clone(), g.clone()
        eager.step()
        graphable.step()
    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    assert graphable.step_count == eager.step_count == 6
    graphable.step_count = 2
    assert graphable.step_count == 2 and graphable._step_t.item() == 2.0


def test_config_default_is_on():
    assert RunConfig().graphed is True
    assert dataclasses.replace(RunConfig(), graphed=False).validate().graphed is False
