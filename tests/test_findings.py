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


def test_readme_lists_every_code():
    import pathlib
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [code for code in CODES if f"`{code}`" not in readme]
    assert not missing, f"README's finding-code table lacks {missing}"


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
