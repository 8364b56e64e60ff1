"""Notebook-sized reprs (issue 17): a few lines of plain text and a well-formed HTML fragment per result."""

from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np

import jaxsane
from jaxsane import Diagnosis, Finding, FitResult, History, InitScaleSweep, OverfitConfig, OverfitResult

_VOID = {"img", "br", "meta", "hr", "input", "link"}


class _Balance(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.tags = [], [], set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def well_formed(fragment: str) -> set[str]:
    """The tags of ``fragment``; fails unless every tag is closed in order and the root is our div."""
    assert fragment.startswith('<div class="jaxsane-repr"') and fragment.endswith("</div>")
    p = _Balance()
    p.feed(fragment)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    return p.tags


def diagnosis(n_extra=0):
    d = Diagnosis([Finding("nonfinite.backward", "grads['w'] has 12 NaN <sqrt>", "double where", step=3,
                           path="grads['w']"),
                   Finding("grad.mismatch", "autodiff disagrees", "fix the vjp", path="params['w']"),
                   *[Finding("step.rng_reused", f"same key in run {i}", "split the key", path=f"p{i}")
                     for i in range(n_extra)]], name="demo")
    return d


def test_finding_and_diagnosis_reprs_are_short_and_carry_the_codes():
    d = diagnosis(n_extra=200)
    f = d[0]
    assert repr(f).startswith("Finding(error nonfinite.backward (step 3, grads['w'])")
    long = Finding("train.plateau", "x" * 5000, extra={"values": list(range(10000))})
    assert len(repr(long)) < 200  # neither the long message nor extra is printed whole
    text = repr(d)
    assert len(text.splitlines()) <= 8 and len(text) < 1500
    assert "'demo'" in text and "not ok" in text and "nonfinite.backward" in text
    assert "and 196 more root causes" in text
    tags = well_formed(d._repr_html_())
    assert {"table", "td", "code", "style"} <= tags
    page = d._repr_html_()
    assert "&lt;sqrt&gt;" in page and "fix: double where" in page and 'data-code="grad.mismatch"' in page
    assert "no findings" in Diagnosis(name="clean")._repr_html_() and "- ok" in repr(Diagnosis())
    well_formed(f._repr_html_())


def _fit_result(leaves=1000, steps=50):
    state = {f"layer_{i}": {"w": jnp.full((4, 4), float(i))} for i in range(leaves)}
    h = History(steps=list(range(1, steps + 1)), loss=[2.0 / (1 + s) for s in range(steps)])
    return FitResult(state=state, history=h, diagnosis=diagnosis(), step=steps, resumed_from=None,
                     stopped_early=False, best_step=40, best_eval_loss=0.125, rollbacks=1, checkpoint_dir=None,
                     metrics_path="/tmp/m.jsonl")


def test_fit_result_repr_of_a_1000_leaf_state_is_under_2kb():
    r = _fit_result()
    text = repr(r)
    assert len(text) < 2048, len(text)
    assert "50 steps" in text and "loss 2 -> 0.04" in text and "best eval 0.125 at step 40" in text
    assert "1000 leaves, 16,000 elements" in text and "1 rollback\n" in text and "nonfinite.backward" in text
    assert str(r) == text  # print(result) is the same few lines
    page = r._repr_html_()
    assert {"table", "img", "figure"} <= well_formed(page)  # the loss curves are drawn
    assert "layer_999" not in page and len(page) < 200_000


def test_fit_repr_of_a_real_run():
    import test_fit as T
    r = jaxsane.fit(T.experiment(n=6), steps=6, **T.FIT)
    text = repr(r)
    assert text.startswith("<FitResult: 6 steps, loss ") and len(text) < 1000
    assert "13 leaves, 637 elements" in text and "codes: none" in text


def test_locate_report_html():
    def f(x):
        return jnp.where(x > 0, jnp.sqrt(x), 0.0).sum()
    report = jaxsane.locate(jax.grad(f), jnp.zeros(3))
    assert report is not None and len(repr(report)) < 400
    page = report._repr_html_()
    assert {"pre", "table"} <= well_formed(page) and "nonfinite.backward" in page


def test_overfit_and_sweep_html_draw_their_plots():
    configs = (OverfitConfig(0, 1e-3, 1.0), OverfitConfig(0, 1e-3, 1.0, baseline=True))
    losses = np.array([[2.0, 1.0, 0.01], [2.0, 1.9, 1.9]])
    r = OverfitResult(configs=configs, losses=losses, accuracy=None, reached=np.array([True, False]),
                      reached_at=np.array([2, -1]), verdicts=("fits", "baseline"), findings=(), target=0.05,
                      target_accuracy=None, steps_run=3, max_steps=3, compiles=1, seconds=0.1, lr_swept=True,
                      batch_size=8)
    assert len(repr(r)) < 300
    page = r._repr_html_()
    assert {"pre", "img"} <= well_formed(page) and "fits" in page
    s = InitScaleSweep(scales=np.array([0.5, 1.0]), layers=("dot 0", "dot 1"), activation_std=np.ones((2, 2)),
                       gradient_std=np.ones((2, 2)), loss=np.array([1.0, np.nan]))
    page = s._repr_html_()
    assert {"table", "img"} <= well_formed(page) and "x0.5" in page and "dot 1" in page
    assert len(repr(s)) < 200
