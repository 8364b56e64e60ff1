"""The fault benchmark as a regression test: every faulty program in benchmarks/faults/ is detected
(all its EXPECTED codes found) and no correct program gets an error finding.

Each program runs only the doctor stages it declares (STAGES) at small sizes, so the whole file fits
in CI's time. ``python benchmarks/faults/run.py`` prints the full table with the baselines.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.faults import run as faults  # noqa: E402
from jaxsane import CODES  # noqa: E402

pytestmark = pytest.mark.slow

STYLES = ("optax", "linen", "nnx", "equinox")
PROGRAMS = faults.discover()
FAULTY = [n for n in PROGRAMS if n.startswith("f")]
CORRECT = [n for n in PROGRAMS if n.startswith("c")]


def test_suite_shape():
    assert len(FAULTY) >= 30 and len(CORRECT) >= 6
    for name in PROGRAMS:
        module = faults.load(name)
        assert module.STYLE in STYLES, name
        assert hasattr(module, "experiment") or hasattr(module, "check"), name
        unknown = [c for c in module.EXPECTED if c not in CODES]
        assert not unknown, f"{name} expects unknown codes {unknown}"
        if name in FAULTY:
            assert module.EXPECTED, f"{name} is faulty but expects no finding"
            assert faults.fault_line(module) is not None, f"{name} has no '# FAULT' line"
        else:
            assert module.EXPECTED == [], name
            assert faults.fault_line(module) is None, f"correct program {name} has a '# FAULT' line"


# error codes that only a job of several real processes can show: the named test file covers each instead
MULTIPROCESS_ONLY = {"dist.hang": "test_dist_hang.py"}


def test_every_error_code_is_covered():
    errors = {code for code, (severity, _, _) in CODES.items() if severity == "error"}
    expected = {code for name in FAULTY for code in faults.load(name).EXPECTED}
    for code, test in MULTIPROCESS_ONLY.items():
        assert f'"{code}"' in (ROOT / "tests" / "dist" / test).read_text(), f"{test} does not check {code}"
    missing = errors - expected - set(MULTIPROCESS_ONLY)
    assert not missing, f"error codes with no faulty program: {sorted(missing)}"


def test_all_step_styles_are_used():
    assert {faults.load(n).STYLE for n in PROGRAMS} == set(STYLES)


def test_fault_line_is_read_from_the_source(tmp_path):
    module = faults.load(FAULTY[0])
    file, line = faults.fault_line(module)
    assert re.search(r"#\s*FAULT", Path(file).read_text().splitlines()[line - 1])


@pytest.mark.parametrize("name", FAULTY)
def test_faulty_program_is_detected(name):
    row = faults.run_program(name, baselines=False)
    assert not row.missing_stages, f"{name}: doctor stages {row.missing_stages} are not registered"
    assert row.detected, (f"{name}: expected {row.expected}, doctor found {row.found or 'nothing'}"
                          + (f" ({row.note})" if row.note else ""))


@pytest.mark.parametrize("name", CORRECT)
def test_correct_program_has_no_error(name):
    row = faults.run_program(name, baselines=False)
    assert not row.errors, f"{name} is correct but doctor reported errors {row.errors} ({row.note})"


def test_totals_count_detections_and_false_positives():
    def row(name, correct, detected, errors, line_exact=None):
        return faults.Row(name, "optax", correct, [] if correct else ["x"], [], errors, detected, line_exact, "",
                          1.0, [], "caught" if not correct else "-", "-")

    t = faults.totals([row("f1", False, True, [], True), row("f2", False, False, [], False),
                       row("c1", True, True, ["data.shape"]), row("c2", True, True, [])])
    assert t["detection"]["n"] == 1 and t["detection"]["of"] == 2
    assert t["line_exact"]["n"] == 1 and t["line_exact"]["of"] == 2
    assert t["false_positive"]["n"] == 1 and t["false_positive"]["of"] == 2
    assert t["undetected"] == ["f2"] and t["false_positives"] == {"c1": ["data.shape"]}
    assert t["debug_nans_detection"]["n"] == 2
