"""Grading SWE-style tasks from canned pytest logs, and the files a patch names."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from polar.app.swe.grading import files_in_patch, files_to_test, grade, parse_pytest_log

F2P = ["tests/test_a.py::test_fixed"]
P2P = ["tests/test_a.py::test_kept", "tests/test_b.py::TestB::test_method"]

PASSING_LOG = """\
============================= test session starts ==============================
platform linux -- Python 3.11.7, pytest-9.0.3, pluggy-1.6.0
collected 3 items

tests/test_a.py ..                                                       [ 66%]
tests/test_b.py .                                                        [100%]

==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED tests/test_a.py::test_fixed
PASSED tests/test_a.py::test_kept
PASSED tests/test_b.py::TestB::test_method
============================== 3 passed in 0.02s ===============================
"""


def test_every_listed_test_passing_scores_1() -> None:
    outcome = grade(F2P, P2P, parse_pytest_log(PASSING_LOG))
    assert outcome.reward == 1.0
    assert outcome.counts() == {"fail_to_pass": "1/1", "pass_to_pass": "2/2"}
    assert outcome.reason == ""


def test_a_failing_fail_to_pass_test_scores_0() -> None:
    log = PASSING_LOG.replace(
        "PASSED tests/test_a.py::test_fixed", "FAILED tests/test_a.py::test_fixed - assert 3 == 4"
    )
    outcome = grade(F2P, P2P, parse_pytest_log(log))
    assert outcome.reward == 0.0
    assert outcome.counts()["fail_to_pass"] == "0/1"
    assert "tests/test_a.py::test_fixed (FAILED)" in outcome.reason


def test_a_missing_pass_to_pass_test_scores_0() -> None:
    log = PASSING_LOG.replace("PASSED tests/test_b.py::TestB::test_method\n", "")
    outcome = grade(F2P, P2P, parse_pytest_log(log))
    assert outcome.reward == 0.0
    assert outcome.counts() == {"fail_to_pass": "1/1", "pass_to_pass": "1/2"}
    assert "tests/test_b.py::TestB::test_method (missing)" in outcome.reason
    assert outcome.failing == ("tests/test_b.py::TestB::test_method",)


def test_an_erroring_test_does_not_pass() -> None:
    log = PASSING_LOG.replace(
        "PASSED tests/test_a.py::test_kept", "ERROR tests/test_a.py::test_kept - fixture 'x' not found"
    )
    assert grade(F2P, P2P, parse_pytest_log(log)).reward == 0.0


def test_parametrised_ids_with_spaces_brackets_and_dashes() -> None:
    ids = [
        "tests/test_p.py::test_f[1-2]",
        "tests/test_p.py::test_f[a b - c]",
        "tests/test_p.py::test_f[x[0]]",
        "tests/test_p.py::TestK::test_g[None]",
    ]
    log = "\n".join(
        [
            "============================= test session starts ==============================",
            "=========================== short test summary info ============================",
            "PASSED tests/test_p.py::test_f[1-2]",
            "FAILED tests/test_p.py::test_f[a b - c] - AssertionError: [1] - [2]",
            "PASSED tests/test_p.py::test_f[x[0]]",
            "XFAIL tests/test_p.py::TestK::test_g[None] - reason: known",
            "SKIPPED [1] tests/test_p.py:9: no network",
            "========================= 1 failed, 2 passed in 0.05s ==========================",
        ]
    )
    results = parse_pytest_log(log)
    assert results == {ids[0]: "PASSED", ids[1]: "FAILED", ids[2]: "PASSED", ids[3]: "XFAIL"}
    assert grade([ids[0], ids[2]], [ids[3]], results).reward == 1.0  # an expected failure counts as passing
    assert grade([ids[1]], [], results).reward == 0.0


def test_verbose_lines_are_read_too() -> None:
    log = "\n".join(
        [
            "============================= test session starts ==============================",
            "tests/test_v.py::test_one PASSED                                         [ 50%]",
            "tests/test_v.py::test_two[a b] FAILED                                    [100%]",
        ]
    )
    assert parse_pytest_log(log) == {"tests/test_v.py::test_one": "PASSED", "tests/test_v.py::test_two[a b]": "FAILED"}


def test_no_output_scores_0_with_the_reason() -> None:
    for log in ("", "ImportError: No module named 'x'\n", "ERROR: file or directory not found: tests/test_a.py\n"):
        outcome = grade(F2P, P2P, parse_pytest_log(log))
        assert outcome.reward == 0.0
        assert outcome.reason == "the test log holds no test results"


def test_lines_a_test_prints_before_the_summary_are_not_results() -> None:
    # A failing test printing what looks like results: its captured output comes before the summary.
    log = PASSING_LOG.replace(
        "==================================== PASSES ====================================",
        "=================================== FAILURES ===================================\n"
        "----------------------------- Captured stdout call -----------------------------\n"
        "PASSED tests/test_a.py::test_fixed\n"
        "tests/test_a.py::test_fixed PASSED",
    ).replace(
        "PASSED tests/test_a.py::test_fixed\nPASSED tests/test_a.py::test_kept",
        "FAILED tests/test_a.py::test_fixed\nPASSED tests/test_a.py::test_kept",
    )
    assert parse_pytest_log(log)["tests/test_a.py::test_fixed"] == "FAILED"


def test_a_task_without_fail_to_pass_tests_never_scores() -> None:
    assert grade([], P2P, parse_pytest_log(PASSING_LOG)).reward == 0.0


@given(
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=20),
    st.sampled_from(["PASSED", "FAILED", "ERROR", "XPASS"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), max_size=30),
)
def test_a_parametrised_id_reads_back_whatever_its_parameters_hold(parameters: str, status: str, message: str) -> None:
    parameters = parameters.replace("[", "(").replace("]", ")")  # pytest's ids keep brackets balanced
    test_id = f"tests/test_h.py::test_h[{parameters}]"
    line = f"{status} {test_id}" + (f" - {message}" if message else "")
    log = f"==== test session starts ====\n==== short test summary info ====\n{line}\n"
    assert parse_pytest_log(log) == {test_id: status}


TEST_PATCH = """\
diff --git a/tests/test_a.py b/tests/test_a.py
index 1111111..2222222 100644
--- a/tests/test_a.py
+++ b/tests/test_a.py
@@ -1,2 +1,5 @@
 def test_kept():
     pass
+
+def test_fixed():
+    pass
diff --git a/tests/data/input.json b/tests/data/input.json
new file mode 100644
--- /dev/null
+++ b/tests/data/input.json
@@ -0,0 +1 @@
+{}
diff --git "a/tests/test \\"odd\\".py" "b/tests/test \\"odd\\".py"
new file mode 100644
"""


def test_files_of_a_test_patch_and_the_ids() -> None:
    assert files_in_patch(TEST_PATCH) == ["tests/test_a.py", "tests/data/input.json", 'tests/test "odd".py']
    ids = ["tests/test_a.py::test_fixed", "tests/test_c.py::test_other[1]", "test_x (module.Class)"]
    # Only test modules run: the data file is not one, and an id without a file adds nothing.
    assert files_to_test(TEST_PATCH, ids) == ["tests/test_a.py", 'tests/test "odd".py', "tests/test_c.py"]
