"""The HTML report: one self-contained, well-formed page with findings, hints and embedded PNG plots."""

import base64
import json
from html.parser import HTMLParser

import numpy as np

from jaxsane import Diagnosis, Finding
from jaxsane._monitor.monitor import History
from jaxsane._render.html import render_html, to_json, write_html

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "img", "br", "hr", "link", "input", "col", "area", "base", "source", "wbr"}


class Page(HTMLParser):
    """Checks nesting while parsing; collects sections, images, findings rows and the JSON payload."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors = [], []
        self.sections, self.images, self.rows, self.scripts = [], [], [], []
        self.text = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs.get("class", ""))
        if tag == "img":
            self.images.append(attrs)
        if tag == "tr" and "finding" in attrs.get("class", ""):
            self.rows.append(attrs.get("data-code"))
        if tag == "script":
            self._in_script = attrs.get("type") == "application/json"
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)
        else:
            self.text.append(data)


def parse(text):
    page = Page()
    page.feed(text)
    page.close()
    assert not page.errors, page.errors[:3]
    assert page.stack == [], page.stack
    assert text.startswith("<!DOCTYPE html>")
    return page


class Plotted:
    """An artifact with the ``.plot() -> Figure`` protocol (like the overfit sweep and the init-scale sweep)."""

    def __init__(self, title):
        self.title = title

    def plot(self):
        from matplotlib.figure import Figure
        fig = Figure()
        ax = fig.add_subplot()
        ax.plot([1, 2, 3], [3, 1, 2])
        ax.set_title(self.title)
        return fig


class Broken:
    def plot(self):
        raise RuntimeError("no data")


def history():
    steps = list(range(20))
    return History(steps=steps, loss=list(np.linspace(2.3, 0.4, 20)), eval_steps=[0, 10, 20],
                   eval_loss=[2.3, 1.0, 0.7], leaf_paths=["params['a']['w']", "params['a']['b']", "params['o']['w']"],
                   depth=[0, 1, 2], weight_leaves=[0, 2], tele_steps=[0, 10], param_norm=[[1.0, 0.1, 1.0]] * 2,
                   update_norm=[[1e-2, 1e-3, 1e-2]] * 2, grad_steps=[0, 10], grad_norm=[[0.5, 0.1, 1.0]] * 2,
                   dead_steps=[0], dead_fraction=[[0.2]])


def diagnosis():
    d = Diagnosis([Finding("train.overfitting", "eval loss rose <fast> & far", "stop earlier", step=12),
                   Finding("nonfinite.backward", "grads NaN", "apply the where to the input of sqrt",
                           path="params['a']['w']", file="model.py", line=41),
                   Finding("overfit.best", "best lr 3e-3")], name="demo <exp>")
    d.artifacts.update(run=history(), overfit=Plotted("sweep"), init_scales=Plotted("scales"))
    return d


def test_page_is_well_formed_with_sections_findings_and_png_plots(tmp_path):
    path = write_html(str(tmp_path / "r.html"), [diagnosis(), Diagnosis(name="clean")])
    text = open(path, encoding="utf-8").read()
    page = parse(text)
    for cls in ("overview", "diagnosis", "findings", "plot loss-curves", "plot grad-norms", "plot overfit-sweep",
                "plot init-scales", "plot update-ratio", "plot dead-relu"):
        assert cls in page.sections, (cls, page.sections)
    assert page.rows == ["nonfinite.backward", "train.overfitting", "overfit.best"]  # errors first
    body = " ".join(page.text)
    assert "eval loss rose <fast> & far" in body and "demo <exp>" in body      # escaped, then read back
    assert "<fast>" not in text.split("<script")[0]                            # never raw in the markup
    assert "fix: apply the where to the input of sqrt" in body and "model.py:41" in body
    assert "no findings" in body                                               # the clean diagnosis
    assert len(page.images) == 6
    for img in page.images:
        src = img["src"]
        assert src.startswith("data:image/png;base64,") and img.get("alt")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    assert "http://" not in text and "https://" not in text                   # self-contained
    (payload,) = page.scripts
    assert json.loads(payload) == json.loads(to_json([diagnosis(), Diagnosis(name="clean")]))


def test_only_existing_artifacts_are_drawn_and_a_broken_one_is_reported():
    d = Diagnosis([Finding("train.plateau", "flat", "raise lr")], name="x")
    page = parse(render_html(d))
    assert page.images == [] and page.rows == ["train.plateau"]
    d.artifacts["overfit"] = Broken()
    d.artifacts["run"] = {"loss": [2.0, 1.5, None, 1.0]}        # the minimal form is accepted
    page = parse(render_html(d))
    assert [s for s in page.sections if s.startswith("plot")] == ["plot loss-curves"]
    assert "could not draw overfit" in " ".join(page.text)


def test_json_form_carries_the_same_findings(tmp_path):
    text = to_json(diagnosis(), str(tmp_path / "r.json"))
    data = json.loads(open(tmp_path / "r.json").read())
    assert json.loads(text) == data
    assert [f["code"] for f in data[0]["findings"]] == ["train.overfitting", "nonfinite.backward", "overfit.best"]
    assert data[0]["findings"][0]["hint"] == "stop earlier"


def test_cli_doctor_writes_html_and_json(tmp_path):
    from jaxsane.cli import main
    html_path, json_path = tmp_path / "d.html", tmp_path / "d.json"
    code = main(["doctor", "jaxsane.examples.digits_optax:experiment", "--stages", "run", "-o", "run_steps=12",
                 "--html", str(html_path), "--json", str(json_path), "-q"])
    assert code == 0
    page = parse(html_path.read_text())
    assert "plot loss-curves" in page.sections and "plot grad-norms" in page.sections
    data = json.loads(json_path.read_text())
    assert data["name"] == "digits_optax" and data["ok"]


# ----------------------------------------------------------------------------- plots that read (issue 18)

from jaxsane._render.plots import plot_dead, plot_grad_norms, plot_losses, plot_update_ratio  # noqa: E402


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    return fig


def many_leaves(n=21, steps=8):
    paths = [f"params['block_{j}']['kernel']" for j in range(n)]
    return History(steps=list(range(steps)), loss=list(np.linspace(2, 1, steps)), leaf_paths=paths,
                   depth=list(range(n)), weight_leaves=list(range(n)), tele_steps=list(range(steps)),
                   param_norm=[[1.0] * n] * steps, update_norm=[[10.0 ** -(1 + j / 5) for j in range(n)]] * steps,
                   grad_steps=list(range(steps)), grad_norm=[[10.0 ** -(j / 4) for j in range(n)]] * steps)


def test_legends_sit_outside_the_axes_and_21_leaves_get_top_k_and_n_more():
    for plot in (plot_update_ratio, plot_grad_norms):
        fig = _drawn(plot(many_leaves()))
        ax = fig.axes[0]
        legend = ax.get_legend()
        texts = [t.get_text() for t in legend.get_texts()]
        assert any(t.startswith("and ") and "more" in t for t in texts), texts
        assert len(texts) <= 14  # 12 curves, the band / "and N more"
        renderer = fig.canvas.get_renderer()
        box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.x0 >= axes_box.x1  # right of the axes: covers no curve, tick or title
        assert box.x1 <= fig.bbox.x1 + 1  # and still inside the figure


def test_nan_loss_run_says_no_finite_values_instead_of_empty_axes():
    h = History(steps=[0, 1, 2], loss=[float("nan")] * 3)
    ax = plot_losses(h).axes[0]
    notes = [t.get_text() for t in ax.texts]
    assert any("no finite values" in t for t in notes), notes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("NaN/Inf loss (3 steps)" in t for t in legend)  # and each NaN step is marked
    assert len([line for line in ax.get_lines() if list(line.get_xdata()) in ([0, 0], [1, 1], [2, 2])]) == 3
    # a finite run has no such note
    assert not plot_losses(History(steps=[0, 1], loss=[1.0, 0.5])).axes[0].texts


def test_skipped_batches_are_marked_on_the_loss_curve():
    ax = plot_losses(History(steps=[0, 1, 3, 4], loss=[2.0, 1.5, 1.2, 1.0]), skipped=[2]).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("skipped batch (1: 2)") for t in legend), legend
    d = diagnosis()
    d.artifacts["skipped_batches"] = [2]
    assert 'class="plot loss-curves"' in render_html(d)


def test_a_run_stopped_at_step_1_gets_integer_step_ticks():
    for fig in (plot_losses(History(steps=[0], loss=[2.3])), plot_grad_norms(many_leaves(n=3, steps=1))):
        ax = _drawn(fig).axes[0]
        ticks = ax.get_xticks()
        assert len(ticks) and np.allclose(ticks, np.round(ticks)), ticks


def test_dead_panel_is_labelled_by_layer_and_absent_without_relu_sites():
    h = history()
    h.relu_labels = ["mlp/hidden"]
    legend = [t.get_text() for t in plot_dead(h).axes[0].get_legend().get_texts()]
    assert "mlp/hidden" in legend
    h.dead_steps, h.dead_fraction = [], []
    assert plot_dead(h) is None
    d = Diagnosis(name="gelu")
    d.artifacts["run"] = h
    assert "dead-relu" not in render_html(d)


def test_gelu_model_has_no_relu_sites_and_relu_models_do():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxsane._monitor.monitor import relu_labels, relu_outputs

    class Block(nnx.Module):
        def __init__(self, act, rngs):
            self.up, self.norm, self.down = nnx.Linear(4, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)
            self.act = act

        def __call__(self, x):
            return self.down(self.act(self.norm(self.up(x))))

    x = jnp.ones((3, 4))
    found = {}
    for name, act in (("gelu", nnx.gelu), ("relu", nnx.relu), ("relu6", jax.nn.relu6),
                      ("maximum", lambda h: jnp.maximum(h, 0))):
        graph, state = nnx.split(Block(act, nnx.Rngs(0)))
        fn = lambda s, x: nnx.merge(graph, s)(x)  # noqa: E731
        found[name] = (len(relu_outputs(fn, state, x)), relu_labels(fn, state, x))
    # LayerNorm's variance clamp max(0, E[x^2] - E[x]^2) is not an activation
    assert found["gelu"] == (0, [])
    assert all(found[k][0] == 1 for k in ("relu", "relu6", "maximum")), found
    assert all(found[k][1][0].startswith("test_report.py:") for k in ("relu", "maximum")), found


def test_html_and_json_carry_the_run_metadata(tmp_path):
    d = diagnosis()
    d.artifacts["meta"] = {"steps": 7, "wall_seconds": 1.5, "timings": {"train": 1.2}, "checkpoint_dir": "/ck",
                           "best_step": 5}
    page = render_html(d)
    section = page[page.index('class="metadata"'):]
    for text in ("wall time", "seconds per stage", "train 1.2", "/ck", "best step", "jax ", "backend", "devices"):
        assert text in section, text
    (entry,) = json.loads(to_json(d))
    meta = entry["meta"]
    assert meta["steps"] == 7 and meta["best_step"] == 5 and "jax" in meta["versions"] and meta["device_count"] >= 1
    # a diagnosis without a run still gets the environment in the report
    plain = Diagnosis(name="plain")
    assert 'class="metadata"' in render_html(plain) and "versions" in json.loads(to_json(plain))[0]["meta"]
