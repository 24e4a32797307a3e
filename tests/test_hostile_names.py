"""Names made from store content: two different groups or experiments never share a header or a file."""
from fastdiag.analysis.groups import file_safe, load_groups
from fastdiag.grokking.config import RunConfig
from fastdiag.store import Store


def test_groups_differing_only_in_lr_have_their_own_names(tmp_path):
    """Before: `plot` printed 7 paths and wrote 4, and `analyze` printed identical headers."""
    cfgs = [RunConfig(weight_decay=w, lr=lr, seed=0, epochs=5, p=11) for lr in (1e-3, 3e-3) for w in (0.1, 1.0)]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        for c in cfgs:
            st.record_done(c.run_id(), {"regime": "grok", "t_grok_epoch": 3, "n_params": 10},
                           [{"epoch": 1, "step": 1, "test_acc": 1.0, "train_acc": 1.0}])
        groups, _ = load_groups(st)
    assert len(groups) == 2
    assert len({g.slug for g in groups}) == 2 and len({g.label for g in groups}) == 2
    assert all("lr" in g.slug and "lr" in g.label for g in groups)
    assert all("/" not in g.slug and not g.slug.startswith(".") for g in groups)


def test_one_group_keeps_its_short_name(tmp_path):
    cfgs = [RunConfig(weight_decay=w, seed=0, epochs=5, p=11) for w in (0.1, 1.0)]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        for c in cfgs:
            st.record_done(c.run_id(), {"regime": "grok"}, [])
        (group,), _ = load_groups(st)
    assert group.distinct == {} and "lr" not in group.slug


def test_ids_that_sanitise_alike_stay_apart():
    names = [file_safe(x) for x in ("a/b", "a.b", "a-b", "../../x", "")]
    assert len(set(names)) == len(names)
    assert names[2] == "a-b"                                 # already safe: unchanged
    assert all(n and "/" not in n and not n.startswith(".") for n in names)
