"""`fastdiag run`: a tiny real run, and bad input as one line with exit status 2."""
import csv
import dataclasses
import json
import subprocess
import sys

import click
import pytest

from fastdiag.cli import main


def _run(capsys, *argv):
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_tiny_run_writes_outputs(capsys, tmp_path):
    out_dir = tmp_path / "run"
    code, out, err = _run(capsys, "run", "--p", "7", "--preset", "custom", "--layers", "1", "--heads", "2",
                          "--d-model", "16", "--epochs", "3", "--batch", "8", "--train-frac", "0.6",
                          "--diag-every", "2", "--device", "cpu", "--out", str(out_dir))
    assert code == 0, err
    assert "regime:" in out and "t_grok:" in out and "result.json" in out
    assert "epoch 1/3  train" in err and "%|" not in err    # not a terminal: a status line, no bar (tests/test_sweep.py)
    result = json.loads((out_dir / "result.json").read_text())
    assert result["config"]["p"] == 7 and result["epochs_run"] == 3
    assert (out_dir / "trace.csv").exists() and (out_dir / "trajectory.png").exists()
    # the summary names the largest s̄ and σ_H with their epochs, read here from the trace it wrote
    rows = list(csv.DictReader((out_dir / "trace.csv").open()))
    for name, key in (("s̄", "s_bar"), ("σ_H", "sigma_h")):
        top = max(rows, key=lambda row: float(row[key]))
        assert f"largest {name} {float(top[key]):.3f} (epoch {top['epoch']})" in out, out


def test_help_lists_the_options(capsys):
    code, out, _ = _run(capsys, "run", "--help")
    assert code == 0
    for option in ("--arch", "--preset", "--layers", "--heads", "--d-model", "--d-ff", "--op", "--p", "--wd",
                   "--lr", "--batch", "--epochs", "--seed", "--train-frac", "--eval-every", "--diag-every",
                   "--patience", "--no-stop-at-grok", "--device", "--out"):
        assert option in out, option


@pytest.mark.parametrize("argv, needle", [
    (["--arch", "gpt"], "arch"),
    (["--op", "^"], "op"),
    (["--op", "/", "--p", "91"], "prime"),
    (["--wd", "-0.5"], "--wd"),
    (["--batch", "0"], "batch"),
    (["--heads", "3"], "divisible"),
    (["--arch", "lstm", "--heads", "4"], "--heads"),
    (["--preset", "7b"], "preset"),
    (["--p", "abc"], "--p"),
    (["--device", "tpu:9"], "device"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = _run(capsys, "run", *argv, "--epochs", "1")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastdiag: error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_every_command_loads_and_the_listing_uses_its_own_words():
    """Commands load lazily (`fastdiag --help` needs no torch): every module named in the table must
    import and provide its command, and the listing's words must be the start of the command's help."""
    from fastdiag.cli import cli

    ctx = click.Context(cli)
    for name, (module, words) in cli.lazy.items():
        command = cli.get_command(ctx, name)
        assert command is not None and command.callback.__module__ == module, name
        assert " ".join(command.help.split()).startswith(words), name


def test_version_is_the_package_version(capsys):
    import fastdiag
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"fastdiag {fastdiag.__version__}"


def test_top_level_help_loads_no_torch():
    code = "import sys; from fastdiag.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "Commands:" in out and "headdim" in out and "export" in out
    assert out.strip().endswith("False")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_sweep_refuses_a_missing_device_before_any_work(capsys, tmp_path):
    store = tmp_path / "s.sqlite"
    code, _, err = _run(capsys, "sweep", "--wd", "0.1,1", "--seeds", "2", "--device", "cuda", "--store", str(store))
    assert code == 2 and err.strip().splitlines() == [
        "fastdiag: error: --device: 'cuda' requested but CUDA is not available on this machine"]
    assert not store.exists()                       # no store, no runs recorded as failed
    code, out, _ = _run(capsys, "sweep", "--wd", "0.1,1", "--device", "cuda", "--store", str(store), "--dry-run")
    assert code == 0 and "2 runs" in out            # planning a GPU sweep on a laptop still works


def test_every_option_has_help_in_one_style():
    """Help for every option, a sentence with a capital and a final full stop (or a [default: ...]);
    export is left to its own issue."""
    from fastdiag.cli import cli

    ctx = click.Context(cli)
    problems = []
    for name in cli.list_commands(ctx):
        if name == "export":
            continue
        for param in cli.get_command(ctx, name).params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            text = (param.help or "").strip()
            if not text or not (text[0].isupper() or not text[0].isalpha()) or not text.endswith((".", "]", ")")):
                problems.append(f"{name} {param.opts[0]}: {text!r}")
    assert not problems, "\n".join(problems)


def test_option_defaults_are_the_settings_dataclasses_defaults():
    """The options generated from a settings dataclass default to its fields' defaults: RunConfig's for
    every command's run options, InterventionSettings' for intervene's own (and its search horizon,
    --epochs, which headdim shares) — except the defaults a command sets on purpose, listed here."""
    from fastdiag.cli import cli
    from fastdiag.cli.intervene import HEADDIM_PATIENCE_EPOCHS
    from fastdiag.grokking.config import RunConfig
    from fastdiag.grokking.intervention_settings import InterventionSettings, parse_heads

    run, settings = RunConfig(), InterventionSettings()
    overrides = {("intervene", "epochs"): settings.max_epochs, ("headdim", "epochs"): settings.max_epochs,
                 ("headdim", "patience"): HEADDIM_PATIENCE_EPOCHS}
    run_names = {f.name for f in dataclasses.fields(RunConfig)}
    settings_names = {f.name for f in dataclasses.fields(InterventionSettings)}
    ctx = click.Context(cli)
    checked = set()
    for command in ("run", "intervene", "headdim"):
        for param in cli.get_command(ctx, command).params:
            if command == "headdim" and param.name == "heads":       # headdim's --heads: a list, not n_heads
                continue
            if param.name in settings_names and command == "intervene":
                want, got = getattr(settings, param.name), param.default
                if param.name == "reinit_heads":                      # typed as text: none typed is ()
                    got = parse_heads(got)
            elif param.name in run_names:
                want, got = overrides.get((command, param.name), getattr(run, param.name)), param.default
            else:
                continue
            assert got == want and type(got) is type(want), (command, param.opts[0], got, want)
            checked.add((command, param.name))
    # every InterventionSettings field is an intervene option but the two that are not flags
    assert {n for c, n in checked if c == "intervene"} >= settings_names - {"reinit_seed_offset", "max_epochs"}
    assert ("run", "weight_decay") in checked and ("headdim", "patience") in checked
