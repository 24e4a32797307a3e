"""Values read back from a store are range-checked, not only type-checked: store content is untrusted
(hand edits, other tools), and an impossible number must be named as damage, never analysed."""
import sqlite3

import pytest

from fastdiag.cli import main
from fastdiag.store import StoreError, open_existing
from tests.helpers import insert_arms, small_store


def edited_store(tmp_path, sql):
    path = tmp_path / "s.sqlite"
    rid = small_store(path)[1].run_id()
    conn = sqlite3.connect(path)
    conn.execute(sql, {"rid": rid})
    conn.commit()
    conn.close()
    return path, rid


@pytest.mark.parametrize("field, value, needle", [
    ("t_grok_epoch", -50, "at least 0"),
    ("t_mem_step", -1, "at least 0"),
    ("n_params", -10, "at least 0"),
    ("final_test_acc", 7.5, "in [0, 1]"),
    ("final_train_acc", -0.1, "in [0, 1]"),
    ("peak_s_bar", 3, "in [0, 1]"),
    ("peak_sigma_h", -2, "at least 0"),
    ("t_grok_epoch", "1e9", "expected a number"),
    ("t_grok_epoch", 1e999, "finite"),                     # JSON Infinity
])
def test_results_out_of_range_are_damage(tmp_path, capsys, field, value, needle):
    text = "9e999" if value == 1e999 else repr(value).replace("'", '"')
    path, rid = edited_store(tmp_path, f"UPDATE runs SET result = json_set(result, '$.{field}', json('{text}')) "
                                       "WHERE run_id = :rid")
    with open_existing(path) as st, pytest.raises(StoreError, match=rf"{rid}: damaged result \({field} is "):
        st.runs()
    with pytest.raises(SystemExit) as exc:
        main(["analyze", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and str(path) in err[0] and needle in err[0], err


@pytest.mark.parametrize("field, value", [("test_acc", 7.5), ("epoch", -3), ("s_bar", 2.0), ("sigma_h", -1)])
def test_trace_rows_out_of_range_are_damage(tmp_path, field, value):
    path, rid = edited_store(tmp_path, f"UPDATE trace SET row = json_set(row, '$.{field}', {value}) "
                                       "WHERE run_id = :rid AND idx = 2")
    with open_existing(path) as st, pytest.raises(StoreError, match=rf"{rid}: damaged trace row 2 \({field} is"):
        st.trace(rid)


def test_values_in_range_and_missing_ones_are_read(tmp_path):
    path, rid = edited_store(tmp_path, "UPDATE runs SET result = json_set(result, '$.t_grok_epoch', json('null'), "
                                       "'$.final_test_acc', 1.0, '$.peak_s_bar', 1.0000000001, '$.t_mem_epoch', 0) "
                                       "WHERE run_id = :rid")
    with open_existing(path) as st:
        assert len(st.runs("done")) == 3 and st.get(rid)["result"]["t_grok_epoch"] is None
        assert len(st.trace(rid)) == 5


def test_a_config_edited_under_its_run_id_is_damage(tmp_path, capsys):
    """Before, a sweep took the stored (edited) run for the real one and skipped it for ever, and
    analysis reported it at the edited λ."""
    from fastdiag import sweep as sw
    from fastdiag.cli.app import create_store

    path, rid = edited_store(tmp_path, "UPDATE runs SET config = json_set(config, '$.weight_decay', 5.0) "
                                       "WHERE run_id = :rid")
    with pytest.raises(SystemExit) as exc:
        main(["analyze", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and rid in err[0] and "edited" in err[0], err
    grid = sw.build_grid({"p": 11, "epochs": 5}, [0.2], [1])              # the run whose config was edited
    assert [c.run_id() for c in grid] == [rid]
    with create_store(path) as st, pytest.raises(StoreError, match=f"{rid}: damaged config.*edited"):
        sw.run_sweep(grid, st, workers=1, threads=1, progress=False, ensemble=1)


def arms_store(path, **columns):
    """A store with the two arms of one intervention seed, valid unless ``columns`` says otherwise."""
    import json

    from fastdiag.grokking.config import RunConfig
    from fastdiag.store import Store

    small_store(path)
    values = {"config": json.dumps(RunConfig(epochs=5, p=11).to_dict()),
              "settings": json.dumps({"after_peak_epochs": 10}),
              "metrics": json.dumps({"peak_sigma_h_after": 0.2, "final_test_acc": 1.0}), **columns}
    with Store(path) as st:
        insert_arms(st, "iv-x", **values)


@pytest.mark.parametrize("columns, needle", [
    ({"config": '{"seed": 0}'}, "damaged config (missing key(s)"),
    ({"metrics": "[1, 2]"}, "damaged metrics (a JSON list"),
    ({"metrics": '{"final_test_acc": "high"}'}, "damaged metrics (final_test_acc is 'high'"),
    ({"result": '{"regime": '}, "damaged result (invalid JSON"),
], ids=["config-without-weight-decay", "metrics-list", "metric-text", "invalid-json"])
def test_damaged_intervention_arms_are_named_and_never_merged(tmp_path, capsys, columns, needle):
    """Before: a KeyError traceback in analyze, an AttributeError in plot, a JSON error naming no
    store, and merge copied the damaged rows on."""
    path = tmp_path / "iv.sqlite"
    arms_store(path, **columns)
    for argv in (["analyze", str(path)], ["plot", str(path), "--out", str(tmp_path / "figs"), "--n-boot", "5"],
                 ["merge", str(tmp_path / "out.sqlite"), str(path)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1, (argv, err)
        assert str(path) in err[0] and "intervention arm 'iv-x-s0-control'" in err[0] and needle in err[0], err
    from fastdiag.store.interventions import has_tables
    with open_existing(tmp_path / "out.sqlite") as out:
        assert not has_tables(out) or out.conn.execute("SELECT COUNT(*) FROM intervention_runs").fetchone() == (0,)


def test_valid_intervention_arms_are_read(tmp_path):
    from fastdiag.store.interventions import load_experiments

    arms_store(tmp_path / "iv.sqlite")
    with open_existing(tmp_path / "iv.sqlite") as st:
        (rows,) = load_experiments(st).values()
        assert [r["arm"] for r in rows] == ["control", "reinit"] and rows[0]["metrics"]["final_test_acc"] == 1.0


def test_minus_zero_weight_decay_is_the_zero_run(tmp_path):
    """`--wd -0` trained λ = 0 a second time under another run id ("-0.0" in its config)."""
    import math

    from fastdiag import sweep as sw
    from fastdiag.grokking.config import RunConfig

    (minus_zero,) = sw.parse_wd("-0")
    assert math.copysign(1.0, minus_zero) == 1.0
    assert RunConfig(weight_decay=minus_zero).run_id() == RunConfig(weight_decay=0.0).run_id()
    assert sw.parse_wd("-0,0,0.1") == [0.0, 0.1]


@pytest.mark.parametrize("argv", [["run", "--seed", str(2**65)], ["sweep", "--wd", "0.1", "--seeds", f"0,{2**65}", "--dry-run"]])
def test_a_seed_beyond_64_bits_names_the_flag(tmp_path, capsys, argv):
    """Before: torch's "Overflow when unpacking long long" (after the store was written, for a sweep)."""
    out = ["--out", str(tmp_path / "run")] if argv[0] == "run" else ["--store", str(tmp_path / "s.sqlite")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--epochs", "1", "--p", "7", *out])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--seed" in err[0] and "64 bits" in err[0], err
