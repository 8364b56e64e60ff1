"""The HTML report: one self-contained, well-formed page with findings, hints and embedded PNG plots."""

import base64
import json
from html.parser import HTMLParser

import numpy as np

from jaxsane import Diagnosis, Finding
from jaxsane._monitor import History
from jaxsane._report import render_html, to_json, write_html

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
