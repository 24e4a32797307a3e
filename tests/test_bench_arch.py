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
