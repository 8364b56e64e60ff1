import json

import pytest

import jaxsane
from jaxsane import CODES, Diagnosis, Finding


def test_finding_defaults_and_rendering():
    f = Finding("grad.mismatch", "autodiff and finite differences disagree", "fix the custom_vjp",
                path="params['dense']['kernel']", step=3, file="model.py", line=41)
    assert f.severity == "error"
    assert f.where == "step 3, params['dense']['kernel'], model.py:41"
    assert str(f).startswith("[error] grad.mismatch (step 3")
    assert "fix: fix the custom_vjp" in str(f)
    with pytest.raises(KeyError, match="unknown finding code"):
        Finding("no.such.code", "x")
    with pytest.raises(ValueError, match="severity"):
        Finding("grad.mismatch", "x", severity="fatal")


def test_every_findings_md_code_is_known_with_its_severity():
    table = {
        "nonfinite.input": "error", "nonfinite.forward": "error", "nonfinite.backward": "error",
        "nonfinite.update": "error", "grad.mismatch": "error", "grad.missing": "error", "step.no_update": "error",
        "step.opt_state_frozen": "error", "step.rng_reused": "warning", "step.recompiles": "warning",
        "init.loss": "warning", "init.scale": "warning", "init.symmetric": "error", "overfit.failed": "error",
        "model.ignores_input": "error", "batch.cross_talk": "error", "data.label_range": "error",
        "data.shape": "error", "data.leakage": "error", "data.duplicates": "warning", "data.imbalance": "warning",
        "data.all_padding": "error", "data.unnormalized": "warning", "train.diverging": "error",
        "train.exploding_grads": "warning", "train.vanishing_grads": "warning", "train.dead_units": "warning",
        "train.plateau": "warning", "train.oscillating": "warning", "train.overfitting": "warning",
        "train.update_ratio": "warning", "dist.replica_divergence": "error", "dist.nonfinite_shard": "error",
    }
    for code, severity in table.items():
        assert CODES[code][0] == severity, code


def test_the_docs_generate_every_code_from_codes():
    """The manual's finding-code page is generated from CODES at build time (docs/_ext/jaxsane_docs.py): the
    page uses the generating directive, and the generator gives one row per code, with its severity, meaning
    and causes. (This replaces the hand-kept README table that a test compared with CODES.)"""
    import pathlib
    import sys

    pytest.importorskip("sphinx")
    docs = pathlib.Path(__file__).parents[2] / "docs"
    assert "```{jaxsane-codes}" in (docs / "reference" / "codes.md").read_text()
    sys.path.insert(0, str(docs / "_ext"))
    try:
        import jaxsane_docs
    finally:
        sys.path.remove(str(docs / "_ext"))
    rows = jaxsane_docs.code_rows()
    assert [row[0] for row in rows] == list(CODES)
    for code, severity, meaning, causes in rows:
        assert severity in ("error", "warning", "info") and meaning and causes, code
    assert sum(len(r) for r in jaxsane_docs.code_families().values()) == len(CODES)


def test_diagnosis_filters_and_json():
    d = Diagnosis([Finding("data.leakage", "3 rows leak"), Finding("data.imbalance", "skewed"),
                   Finding("overfit.best", "lr 3e-3")], name="demo")
    assert not d.ok and len(d.errors) == 1 and len(d.warnings) == 1
    assert [f.code for f in d.by_code("data")] == ["data.leakage", "data.imbalance"]
    assert d.by_code("data.leak") == []
    assert d.codes == ["data.leakage", "data.imbalance", "overfit.best"]
    payload = json.loads(d.to_json())
    assert payload["ok"] is False and payload["counts"] == {"error": 1, "warning": 1, "info": 1}
    assert payload["findings"][0]["code"] == "data.leakage"
    assert Diagnosis([Finding("overfit.best", "x")]).ok
    assert "1 error" in str(d)


def test_extra_with_numpy_values_is_json_serialisable():
    import numpy as np
    f = Finding("data.duplicates", "dupes", extra={"indices": np.arange(3), "ratio": np.float32(0.5)})
    assert json.loads(json.dumps(f.to_dict()))["extra"] == {"indices": [0, 1, 2], "ratio": 0.5}


def test_render_does_not_crash(capsys):
    from rich.console import Console
    Diagnosis([Finding("grad.missing", "no grad [x]", "remove stop_gradient")]).render(Console(force_terminal=False))
    assert "grad.missing" in capsys.readouterr().out


def test_error_prefix():
    assert str(jaxsane.JaxsaneError("boom")) == "[jaxsane] boom"
    assert str(jaxsane.JaxsaneError("[jaxsane] boom")) == "[jaxsane] boom"


# ----------------------------------------------------------------------------- root causes and consequences

def _label_bug_findings():
    """One bug (labels 1..C) as the stages report it: a label-range error and everything it breaks."""
    nan = float("nan")
    return [Finding("data.label_range", "8 of 32 train examples have labels outside [0, 4)", "use y - 1",
                    path="train labels"),
            Finding("init.loss", "the loss at init is nan", "locate it", severity="error", extra={"loss": nan}),
            *[Finding("grad.mismatch", f"leaf {i}: autodiff 0.1 vs finite differences nan", "check custom_vjp",
                      path=f"params['l{i}']['w']", extra={"autodiff": 0.1, "finite_diff": nan}) for i in range(6)],
            Finding("overfit.failed", "none of 6 configurations fit", "check the labels"),
            Finding("nonfinite.forward", "step 0 produced NaN in metrics['loss']", "clip gather's inputs", step=0,
                    path="metrics['loss']", file="model.py", line=12),
            Finding("overfit.best", "best lr 3e-3")]


def test_one_bug_is_one_root_error_with_its_consequences_folded():
    d = Diagnosis(_label_bug_findings(), name="labels")
    assert [f.code for f in d.root_causes] == ["data.label_range", "overfit.best"]
    root = d.root_causes[0]
    folded = d.consequences_of(root)
    assert [f.code for f in folded] == ["init.loss"] + ["grad.mismatch"] * 6 + ["overfit.failed", "nonfinite.forward"]
    assert all(f.caused_by == jaxsane._core.finding.RootCause("data.label_range", "train labels") for f in folded)
    assert not d.ok and d.counts() == {"error": 1, "warning": 0, "info": 1}
    # every finding is still there, in order, for code that filters by code
    assert len(d) == 11 and len(d.errors) == 10 and [f.code for f in d][0] == "data.label_range"
    # the non-finite finding's fix names the label problem first
    (nf,) = d.by_code("nonfinite.forward")
    assert nf.hint.startswith("check the labels first: 8 of 32 train examples have labels outside [0, 4)")
    assert "clip gather's inputs" in nf.hint
    # terminal: the root leads, the consequences are folded beneath it, one error in the headline
    text = str(d)
    assert text.splitlines()[0].startswith("jaxsane diagnosis of labels: 1 error, 0 warnings, 1 info")
    assert "9 consequences folded" in text.splitlines()[0]
    assert text.splitlines()[1].startswith("[error] data.label_range")
    assert text.index("consequences (9)") < text.index("grad.mismatch") < text.index("[info] overfit.best")
    # JSON: root_causes with nested consequences, and the flat findings list kept for compatibility
    payload = json.loads(d.to_json())
    assert payload["ok"] is False and payload["counts"]["error"] == 1 and payload["consequences"] == 9
    assert [r["code"] for r in payload["root_causes"]] == ["data.label_range", "overfit.best"]
    assert len(payload["root_causes"][0]["consequences"]) == 9 and payload["root_causes"][1]["consequences"] == []
    assert len(payload["findings"]) == 11
    assert payload["findings"][2]["caused_by"] == {"code": "data.label_range", "where": "train labels"}
    back = Finding(**payload["findings"][2])                      # read back from JSON
    assert back.caused_by == folded[1].caused_by


def test_ok_and_exit_code_are_decided_by_root_causes():
    from jaxsane._core.root_cause import link_consequences
    # a warning root whose consequence is an error fails the gate, once
    nan_loss = Finding("init.loss", "the loss at init is nan", extra={"loss": float("nan")})
    assert nan_loss.severity == "warning"
    d = Diagnosis([nan_loss, Finding("overfit.failed", "no fit")])
    assert [f.code for f in d.root_causes] == ["init.loss"] and d.severity_of(d.root_causes[0]) == "error"
    assert not d.ok and d.counts()["error"] == 1 and d.counts()["warning"] == 0
    # a finite init.loss is a plain warning: it is not a root of the overfit failure
    d = Diagnosis([Finding("init.loss", "loss at init 3.1", extra={"loss": 3.1}), Finding("overfit.failed", "no fit")])
    assert [f.code for f in d.root_causes] == ["overfit.failed", "init.loss"] and d.counts()["error"] == 1
    # warnings alone pass
    d = Diagnosis([Finding("step.no_update", "frozen", severity="warning"), Finding("train.plateau", "flat")])
    assert d.ok and [f.code for f in d.root_causes] == ["step.no_update"]
    # the pure linker keeps order and never drops a finding
    fs = _label_bug_findings()
    linked = link_consequences(fs)
    assert [f.code for f in linked] == [f.code for f in fs]
    assert sum(f.caused_by is None for f in linked) == 2


def test_cli_exit_code_follows_the_root_causes(monkeypatch, tmp_path):
    from jaxsane import cli
    diagnoses = {"bug": Diagnosis(_label_bug_findings(), name="bug"),
                 "clean": Diagnosis([Finding("overfit.best", "lr 3e-3")], name="clean")}
    monkeypatch.setattr("jaxsane._doctor.doctor.doctor", lambda exp, **kw: diagnoses[exp])
    monkeypatch.setattr(cli, "load_target", lambda target, raw=False: target.split(":")[1])
    monkeypatch.setattr(cli, "check_target", lambda target: None)
    out = tmp_path / "r.json"
    assert cli.main(["doctor", "-q", "x:bug", "x:clean", "--json", str(out)]) == cli.EXIT_ERRORS
    assert cli.main(["doctor", "-q", "x:clean"]) == cli.EXIT_OK
    payload = json.loads(out.read_text())
    assert payload[0]["counts"]["error"] == 1 and len(payload[0]["root_causes"][0]["consequences"]) == 9


def test_rules_link_only_what_a_root_can_cause():
    def roots(*findings):
        d = Diagnosis(findings)
        return {f.code: (f.caused_by.code if f.caused_by else None) for f in d}

    # a step that never updates: no fit, input-blind verdict and a flat loss follow; a cross-talk bug does not
    got = roots(Finding("step.no_update", "params unchanged"), Finding("model.ignores_input", "real = const"),
                Finding("overfit.failed", "no fit"), Finding("train.plateau", "flat"),
                Finding("train.update_ratio", "tiny", extra={"direction": "low"}),
                Finding("batch.cross_talk", "softmax over batch"), Finding("train.diverging", "rose"))
    assert got == {"step.no_update": None, "model.ignores_input": "step.no_update", "overfit.failed": "step.no_update",
                   "train.plateau": "step.no_update", "train.update_ratio": "step.no_update",
                   "batch.cross_talk": None, "train.diverging": None}
    # an input-blind model cannot fit; with no other root it leads
    assert roots(Finding("model.ignores_input", "x"), Finding("overfit.failed", "y")) == {
        "model.ignores_input": None, "overfit.failed": "model.ignores_input"}
    # NaN inputs -> forward NaN -> backward NaN -> update NaN and the overfit: one root, chains resolved
    got = roots(Finding("nonfinite.update", "u"), Finding("nonfinite.backward", "b"), Finding("overfit.failed", "o"),
                Finding("nonfinite.forward", "f"), Finding("nonfinite.input", "batch has NaN"))
    assert set(got.values()) == {None, "nonfinite.input"} and got["nonfinite.input"] is None
    # without the data root, the forward NaN leads (the order a step computes values in)
    got = roots(Finding("nonfinite.update", "u"), Finding("nonfinite.backward", "b"), Finding("nonfinite.forward", "f"))
    assert got == {"nonfinite.update": "nonfinite.forward", "nonfinite.backward": "nonfinite.forward",
                   "nonfinite.forward": None}
    # the same NaN found by two stages: the located one leads, whatever the order
    d = Diagnosis([Finding("nonfinite.forward", "loss nan at the check point"),
                   Finding("nonfinite.forward", "step 0: loss nan", step=0, file="m.py", line=3)])
    assert [f.where for f in d.root_causes] == ["step 0, m.py:3"] and d[0].caused_by.where == "step 0, m.py:3"
    # two located NaNs at different lines are two bugs
    d = Diagnosis([Finding("nonfinite.forward", "a", file="m.py", line=3), Finding("nonfinite.forward", "b",
                                                                                    file="m.py", line=9)])
    assert len(d.root_causes) == 2
    # a wrong custom_vjp checked at init is not a consequence of a NaN that appears at step 38
    d = Diagnosis([Finding("grad.mismatch", "wrong rule", path="params['w']", extra={"autodiff": 1.0,
                                                                                     "finite_diff": -1.0}),
                   Finding("nonfinite.forward", "step 38: nan", step=38, file="m.py", line=3),
                   Finding("train.diverging", "rose", step=20)])
    assert {f.code for f in d.root_causes} == {"grad.mismatch", "nonfinite.forward", "train.diverging"}
    # ... but a NaN loss at init makes it garbage
    d = Diagnosis([Finding("grad.mismatch", "x", path="params['w']"), Finding("nonfinite.forward", "nan", step=0)])
    assert [f.code for f in d.root_causes] == ["nonfinite.forward"]
    # a preset caused_by is kept and resolved to the root
    from jaxsane._core.finding import RootCause
    d = Diagnosis([Finding("data.label_range", "bad", path="y"), Finding("nonfinite.forward", "nan", step=0),
                   Finding("batch.cross_talk", "x", caused_by=RootCause("nonfinite.forward", "step 0"))])
    assert d[2].caused_by == RootCause("data.label_range", "y") and len(d.root_causes) == 1
    with pytest.raises(TypeError, match=r"\[jaxsane\] Finding.caused_by"):
        Finding("grad.mismatch", "x", caused_by="nonfinite.forward")


def test_identical_findings_at_many_steps_are_one_finding_with_a_count():
    d = Diagnosis(name="dup")
    for step in (7, 3, 12):
        d.add(Finding("nonfinite.update", f"step {step}: opt_state['mu'] has 4 NaN", "lower eps", step=step,
                      path="opt_state['mu']"))
    d.add(Finding("nonfinite.update", "step 5: opt_state['nu'] has 4 NaN", "lower eps", step=5, path="opt_state['nu']"))
    d.add(Finding("nonfinite.update", "step 9: opt_state['mu'] has 9 NaN", "lower eps", step=9, path="opt_state['mu']"))
    assert len(d) == 3                                        # other path, other count: separate findings
    f = d[0]
    assert f.count == 3 and f.step == f.first_step == 3 and f.last_step == 12
    assert f.message == "step 3: opt_state['mu'] has 4 NaN"   # the earliest one's text
    assert f.where == "steps 3..12, opt_state['mu']" and " x3: " in str(f)
    assert json.loads(d.to_json())["findings"][0]["count"] == 3
    assert d[1].count == 1 and d[2].count == 1
    # the step number inside the message is what may differ; exact repeats without a step fold too
    d = Diagnosis([Finding("doctor.skipped", "stage 'x' skipped"), Finding("doctor.skipped", "stage 'x' skipped")])
    assert len(d) == 1 and d[0].count == 2 and d[0].where == ""
    d = Diagnosis([Finding("train.plateau", "flat over 30 steps", step=29), Finding("train.plateau", "flat over 31 steps",
                                                                                      step=29)])
    assert len(d) == 2                                        # a number that is not the step number is content


def test_html_findings_table_leads_with_roots_and_folds_consequences():
    from jaxsane._render.html import render_html
    page = render_html([Diagnosis(_label_bug_findings(), name="labels")])
    table = page.split('<table class="findings">')[1].split("</table>")[0]
    rows = table.split("<tr ")[1:]
    assert rows[0].startswith('class="finding root" data-code="data.label_range"') and "9 consequences" in rows[0]
    assert all(r.startswith('class="finding consequence"') and 'data-caused-by="data.label_range"' in r
               for r in rows[1:10])
    assert rows[10].startswith('class="finding root" data-code="overfit.best"')
    assert "fix: use y - 1" in rows[0] and "fix:" not in rows[1]          # one fix: the root's
    assert "1 error, 0 warnings, 1 info (root causes; 9 consequences folded beneath them)" in page


def _off_by_one_classifier(offset):
    """A tiny pure-optax MLP classifier over C=4 classes with labels ``offset .. C - 1 + offset``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    C = 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = (np.arange(32) % C + offset).astype(np.int32)
    tx = optax.adam(1e-2)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"h": {"w": jax.random.normal(k1, (6, 16)) * 0.4, "b": jnp.zeros(16)},
                  "o": {"w": jax.random.normal(k2, (16, C)) * 0.25, "b": jnp.zeros(C)}}
        return params, tx.init(params)

    def apply(params, x):
        return jax.nn.relu(x @ params["h"]["w"] + params["h"]["b"]) @ params["o"]["w"] + params["o"]["b"]

    def loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()

    @jax.jit
    def step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train={"x": x, "y": y}, loss=loss, apply=apply, num_classes=C,
                              name=f"labels_from_{offset}")


@pytest.mark.slow
def test_doctor_on_off_by_one_labels_leads_with_the_label_range_and_folds_the_rest():
    d = jaxsane.doctor(_off_by_one_classifier(1), progress=False, run_steps=8, overfit_steps=60, overfit_seeds=1,
                       step_calls=2)
    root = d.root_causes[0]
    assert root.code == "data.label_range", str(d)
    assert [r.code for r in d.root_causes if d.severity_of(r) == "error"] == ["data.label_range"], str(d)
    folded = {f.code for f in d.consequences_of(root)}
    assert {"nonfinite.forward", "overfit.failed"} <= folded, str(d)
    assert not d.by_code("grad.mismatch") and not d.by_code("grad.missing"), str(d)
    assert all(f.hint.startswith("check the labels first") for f in d.by_code("nonfinite")), str(d)
    assert not d.ok and d.counts()["error"] == 1
    assert str(d).splitlines()[1].startswith("[error] data.label_range")
    # the same program with labels 0..C-1: nothing to fold, no error from the same stages
    clean = jaxsane.doctor(_off_by_one_classifier(0), stages=["data", "init", "grads"], progress=False)
    assert clean.ok and not clean.consequences, str(clean)


def test_a_layer_without_gradient_is_one_root():
    def missing(path, depends=True):
        return Finding("grad.missing", f"{path} gets zero gradient", path=path, extra={"depends": depends})

    d = Diagnosis([missing("params['enc']['kernel']"), missing("params['enc']['bias']"),
                   missing("params['head']['bias']", depends=False),
                   Finding("train.update_ratio", "too small", path="params['enc']['kernel']", step=29,
                           extra={"direction": "low"}),
                   Finding("train.vanishing_grads", "vanish", path="params['enc']['kernel']", step=29),
                   Finding("train.vanishing_grads", "vanish", path="params['head']['kernel']", step=29),
                   Finding("train.update_ratio", "too large", path="params['enc']['kernel']", step=29,
                           extra={"direction": "high"})])
    roots = {(f.code, f.path) for f in d.root_causes}
    assert roots == {("grad.missing", "params['enc']['kernel']"), ("grad.missing", "params['head']['bias']"),
                     ("train.vanishing_grads", "params['head']['kernel']"),
                     ("train.update_ratio", "params['enc']['kernel']")}
    assert [f.path for f in d.consequences_of(d.root_causes[0])] == ["params['enc']['bias']"] * 1 + [
        "params['enc']['kernel']"] * 2
    # NNX paths: the monitor names the leaf with its .value, the gradient check without
    d = Diagnosis([missing("model['hidden']['kernel']"),
                   Finding("train.update_ratio", "too small", path="model['hidden']['kernel'].value", step=29,
                           extra={"direction": "low"})])
    assert len(d.root_causes) == 1 and d[1].caused_by.code == "grad.missing"
    # flat top-level leaves have no layer in common: two unused parameters are two findings
    assert len(Diagnosis([missing("params['w']"), missing("params['b']")]).root_causes) == 2


def test_bad_values_get_jaxsane_errors():
    from jaxsane._core.errors import FindingError
    with pytest.raises(FindingError, match=r"^\[jaxsane\] Finding.count must be >= 1"):
        Finding("grad.mismatch", "x", count=0)
    with pytest.raises(FindingError, match=r"Diagnosis.add takes Finding objects"):
        Diagnosis().add(["not a finding"])
    d = Diagnosis([Finding("grad.mismatch", "x")])
    with pytest.raises(FindingError, match="not a finding of this diagnosis"):
        d.consequences_of(Finding("data.leakage", "y"))
    assert d.consequences_of(d.root_causes[0]) == []


def test_train_findings_follow_a_nan_only_when_the_run_met_it():
    def root_of(*findings):
        return {f.code: (f.caused_by.code if f.caused_by else None) for f in Diagnosis(findings)}

    # a NaN gradient found by the float64 check at init, and a finite run that plateaued: two facts
    assert root_of(Finding("nonfinite.backward", "grads nan at init"),
                   Finding("train.plateau", "flat", step=29))["train.plateau"] is None
    # a NaN met at step 5 of the run, skipped, and the loss then flat: one bug
    assert root_of(Finding("nonfinite.update", "step 5: nan", step=5),
                   Finding("train.plateau", "flat", step=29))["train.plateau"] == "nonfinite.update"
    # the detector's own "went non-finite" verdict follows any non-finite fact
    assert root_of(Finding("nonfinite.forward", "nan", file="m.py", line=3),
                   Finding("train.diverging", "went non-finite", step=20, extra={"nonfinite_from": 20})
                   )["train.diverging"] == "nonfinite.forward"


def test_where_names_a_notebook_cell_not_its_temporary_path():
    # ipykernel compiles each cell to /tmp/ipykernel_<pid>/<hash>.py: a path no reader can open, and one that
    # changes with every kernel (so executed notebooks would differ run to run)
    cell = Finding("init.scale", "m", file="/tmp/ipykernel_4242/667549009.py", line=6, path="params[1]")
    assert cell.where == "params[1], <cell>, line 6"
    assert "ipykernel" not in str(cell)
    assert Finding("init.scale", "m", file="/src/model.py", line=6).where == "/src/model.py:6"  # files: as given


def test_init_scale_message_names_a_notebook_cell():
    from jaxsane._checks.init import LayerStats, check_activations

    def layer(i, rms):
        return LayerStats(i, f"params[{i}]", "dense", f"/tmp/ipykernel_4242/12345.py:{10 + i}", (8, 16), 16, "relu",
                          False, 0.0, rms, rms, 0.0, rms, 0.5, float("nan"), 1.0)

    (f,) = check_activations([layer(i, 0.1 ** i) for i in range(4)])
    assert f.code == "init.scale" and "ipykernel" not in str(f) and "<cell>, line 11" in f.message  # the first largest jump
