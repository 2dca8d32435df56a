"""`polar tasks import swe`: dataset instances of each flavor into tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar.app.swe.grading import files_in_patch
from polar.app.swe.instances import ImportOptions, InstanceError, import_tasks
from polar.rollout.tasks import normalize_task, validate_task

GOLD = """\
diff --git a/astropy/modeling/separable.py b/astropy/modeling/separable.py
--- a/astropy/modeling/separable.py
+++ b/astropy/modeling/separable.py
@@ -242 +242 @@ def _cstack(left, right):
-        cright[-right.shape[0]:, -right.shape[1]:] = 1
+        cright[-right.shape[0]:, -right.shape[1]:] = right
"""
TEST_PATCH = """\
diff --git a/astropy/modeling/tests/test_separable.py b/astropy/modeling/tests/test_separable.py
--- a/astropy/modeling/tests/test_separable.py
+++ b/astropy/modeling/tests/test_separable.py
@@ -1 +1,3 @@
 import pytest
+def test_nested_compound_models():
+    pass
"""
F2P = ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"]
P2P = [
    "astropy/modeling/tests/test_separable.py::test_coord_matrix",
    "astropy/modeling/tests/test_separable.py::test_cdot",
]
PROBLEM = "Modeling's `separability_matrix` does not compute separability correctly for nested CompoundModels"


def swebench_record(**changes) -> dict:
    """A SWE-bench instance as the dataset writes it: test lists as JSON strings."""
    record = {
        "instance_id": "astropy__astropy-12907",
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "problem_statement": PROBLEM,
        "hints_text": "Looks like the right matrix is replaced by ones.",
        "patch": GOLD,
        "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": json.dumps(F2P),
        "PASS_TO_PASS": json.dumps(P2P),
        "version": "4.3",
        "created_at": "2022-03-03T15:14:54Z",
    }
    record.update(changes)
    return record


def swegym_record() -> dict:
    """A SWE-Gym instance: the same fields, test lists as JSON lists."""
    return swebench_record(instance_id="getmoto__moto-5752", repo="getmoto/moto", FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)


def write_jsonl(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_swebench_instances_run_in_their_image(tmp_path: Path) -> None:
    [task] = import_tasks(write_jsonl(tmp_path / "i.jsonl", swebench_record()), ImportOptions(flavor="swebench"))
    assert validate_task(normalize_task(task)) == []
    assert task.task_id == "astropy__astropy-12907"
    assert task.runtime.kind == "docker"
    assert task.runtime.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    # The workspace is the image's /testbed (filled from the image), not a copy beside it.
    assert (task.runtime.workdir, [*task.runtime.prepare]) == ("/testbed", [])
    swe = task.evaluator.swe
    assert task.evaluator.kind == "swe"
    assert (list(swe.fail_to_pass), list(swe.pass_to_pass)) == (F2P, P2P)
    assert (swe.test_patch, swe.gold_patch, swe.instance_id) == (TEST_PATCH, GOLD, "astropy__astropy-12907")
    assert files_in_patch(swe.test_patch) == ["astropy/modeling/tests/test_separable.py"]
    assert task.harness.preset == "pi"


def test_swegym_lists_and_image_rule(tmp_path: Path) -> None:
    [task] = import_tasks(write_jsonl(tmp_path / "i.jsonl", swegym_record()), ImportOptions(flavor="swegym"))
    assert task.runtime.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest"
    assert (list(task.evaluator.swe.fail_to_pass), list(task.evaluator.swe.pass_to_pass)) == (F2P, P2P)


def test_an_image_template_overrides_the_rule(tmp_path: Path) -> None:
    options = ImportOptions(flavor="swebench", image_template="mirror.example/swe/{instance_id_1776}:v2")
    [task] = import_tasks(write_jsonl(tmp_path / "i.jsonl", swebench_record()), options)
    assert task.runtime.image == "mirror.example/swe/astropy_1776_astropy-12907:v2"


def test_nothing_of_the_answer_is_in_the_instruction(tmp_path: Path) -> None:
    for hints in (False, True):
        [task] = import_tasks(
            write_jsonl(tmp_path / "i.jsonl", swebench_record()), ImportOptions("swebench", hints=hints)
        )
        assert PROBLEM in task.instruction
        assert ("right matrix is replaced" in task.instruction) is hints
        secrets = [*F2P, *P2P, "test_nested_compound_models", "test_separable", "= right", "cright"]
        assert [secret for secret in secrets if secret in task.instruction] == []
        assert "diff --git" not in task.instruction


def test_r2e_instances(tmp_path: Path) -> None:
    record = {
        "repo_name": "pillow",
        "commit_hash": "0123456789abcdef0123456789abcdef01234567",
        "docker_image": "namanjain12/pillow_final:0123456789ab",
        "problem_statement": "Image.crop loses the palette.",
        "expected_output_json": json.dumps(
            {"test_crop.py::test_palette": "PASSED", "test_crop.py::test_slow": "FAILED"}
        ),
    }
    [task] = import_tasks(write_jsonl(tmp_path / "i.jsonl", record), ImportOptions(flavor="r2e"))
    assert task.runtime.image == "namanjain12/pillow_final:0123456789ab"
    assert list(task.evaluator.swe.fail_to_pass) == ["test_crop.py::test_palette"]
    assert task.evaluator.swe.test_command == "bash /root/run_tests.sh"
    assert validate_task(normalize_task(task)) == []


def test_a_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "i.json"
    path.write_text(json.dumps([swebench_record(), swegym_record()]))
    assert [task.task_id for task in import_tasks(path, ImportOptions("swebench"))] == [
        "astropy__astropy-12907",
        "getmoto__moto-5752",
    ]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"base_commit": None}, "i.jsonl:2: base_commit: required"),
        ({"FAIL_TO_PASS": "not json"}, "i.jsonl:2: FAIL_TO_PASS: a string that is not a JSON list"),
        ({"FAIL_TO_PASS": "[]"}, "i.jsonl:2: FAIL_TO_PASS: the list is empty"),
        ({"PASS_TO_PASS": [1, 2]}, "i.jsonl:2: PASS_TO_PASS: expected a list of test ids"),
        ({"repo": "../etc"}, "i.jsonl:2: repo: '../etc' is not 'owner/name'"),
    ],
)
def test_a_bad_instance_is_named_by_line_and_field(tmp_path: Path, change: dict, named: str) -> None:
    path = write_jsonl(tmp_path / "i.jsonl", swegym_record(), swebench_record(**change))
    with pytest.raises(InstanceError, match=None) as raised:
        import_tasks(path, ImportOptions("swebench"))
    assert named in str(raised.value)


def test_local_checkouts_must_hold_the_base_commit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "i.jsonl", swebench_record())
    (tmp_path / "repos").mkdir()
    with pytest.raises(InstanceError) as raised:
        import_tasks(path, ImportOptions("swebench", local=tmp_path / "repos"))
    assert "astropy__astropy-12907: no git checkout at" in str(raised.value)
    assert "repos/astropy/astropy" in str(raised.value)


def test_parquet_instances(tmp_path: Path) -> None:
    parquet = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed")
    import pyarrow

    path = tmp_path / "i.parquet"
    records = [swebench_record(), swebench_record(instance_id="getmoto__moto-5752", repo="getmoto/moto")]
    parquet.write_table(pyarrow.Table.from_pylist(records), path)
    tasks = import_tasks(path, ImportOptions("swegym"))
    assert [list(task.evaluator.swe.fail_to_pass) for task in tasks] == [F2P, F2P]
