"""`fastdiag bench`'s architecture rows: a Mamba training step beside the transformer's."""
import torch

from fastdiag import bench


def test_bench_arch_steps_times_every_model_against_the_transformer(one_thread):
    rows = bench.bench_arch_steps(torch.device("cpu"), blocks=2, block_steps=1, progress=lambda _: None)
    by_name = {r.name: r for r in rows}
    assert list(by_name) == list(bench.ARCH_STEPS)
    assert by_name["transformer"].vs_transformer == 1.0
    assert by_name["transformer"].n_params == 818_816
    # the parameter-matched transformer is within 0.1 % of the Mamba's count
    assert abs(by_name["transformer-0.96M"].n_params / by_name["mamba"].n_params - 1) < 1e-3
    assert all(r.ms_per_step > 0 and r.vs_transformer > 0 for r in rows)
    table = bench.format_arch_table([r.__dict__ for r in rows])
    assert "mamba" in table and "958,208" in table


def test_bench_sdpa_step_times_attach_against_bare_and_eager(one_thread):
    """The step-level SDPA comparison: real `attach(every=1)` and the eager + output_attentions
    alternative, each against the bare step, and the model left as it was."""
    row = bench.bench_sdpa_step(torch.device("cpu"), rounds=3, block_steps=1, progress=lambda _: None)
    assert row.base_ms > 0 and row.with_stats_ms > 0 and row.eager_ms > 0
    assert row.with_stats_ratio > 0 and row.eager_ratio > 0
    table = bench.format_sdpa_step_table([row.__dict__])
    assert "hf-gpt2" in table
