"""The compatibility table is made from the lanes' JUnit results: each cell says what that lane's tests of
the feature did (passed, failed, skipped with the reason, or not run there), never what someone wrote."""

from __future__ import annotations

from pathlib import Path

from kvpush_tools.compat import table

LANES = """# name vllm nixl torch
main 0.32.0 1.5.1 2.13.0
neuron 0.24.0 1.3.2 2.11.0
"""


def junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """A JUnit file of ``(classname, name, outcome)`` cases; outcome is ``passed``, ``failed`` or a skip
    reason."""
    body = []
    for cls, name, outcome in cases:
        inner = ""
        if outcome == "failed":
            inner = '<failure message="boom"/>'
        elif outcome != "passed":
            inner = f'<skipped message="{outcome}"/>'
        body.append(f'<testcase classname="{cls}" name="{name}" time="0.1">{inner}</testcase>')
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')


def rows(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| feature"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def test_cells_say_what_each_lane_ran(tmp_path: Path) -> None:
    (tmp_path / "lanes").write_text(LANES)
    junit(
        tmp_path / "main.xml",
        [
            ("tests.test_e2e_vllm", "test_outputs_equal", "passed"),
            ("tests.test_e2e_families", "test_outputs[mla]", "passed"),
            ("tests.test_e2e_families", "test_outputs[gdn]", "passed"),
            ("tests.test_rendezvous", "test_pairs", "passed"),
            ("tests.test_flood_nixl", "test_flood", "passed"),
        ],
    )
    junit(tmp_path / "neuron-core.xml", [("tests.test_rendezvous", "test_pairs", "failed")])
    junit(
        tmp_path / "neuron-e2e.xml",
        [
            ("tests.test_e2e_vllm", "test_outputs_equal", "passed"),
            ("tests.test_e2e_families", "test_outputs[mla]", "passed"),
            ("tests.test_e2e_families", "test_outputs[gdn]", "Skipped: a D of gdn's groups is refused"),
        ],
    )
    text = table(tmp_path, tmp_path / "lanes")
    assert "main: vLLM 0.32.0, NIXL 1.5.1, torch 2.13.0" in text
    assert "neuron: vLLM 0.24.0, NIXL 1.3.2, torch 2.11.0" in text
    got = rows(text)
    assert got["e2e core: equal outputs, swap, by transfer, pools"] == ["passed 1", "passed 1"]
    assert got["MLA e2e"] == ["passed 1", "passed 1"]
    assert got["GDN (state) e2e"] == ["passed 1", "skipped: a D of gdn's groups is refused"]
    assert got["pure rules (unit)"] == ["passed 1", "FAILED 1 of 1"]
    assert got["NIXL multi-process (UCX)"] == ["passed 1", "main lane only"]
    assert "other model families e2e" not in got


def test_a_feature_a_lane_did_not_run_says_so(tmp_path: Path) -> None:
    (tmp_path / "lanes").write_text(LANES)
    junit(tmp_path / "main.xml", [("tests.test_conformance", "test_host", "passed")])
    junit(tmp_path / "neuron-core.xml", [("tests.test_vllm_compat", "test_range", "passed")])
    got = rows(table(tmp_path, tmp_path / "lanes"))
    assert got["conformance (host backend)"] == ["passed 1", "main lane only"]
    assert got["vLLM compat and layouts (unit, real classes)"] == ["main lane only", "passed 1"]


def test_the_newest_vllm_is_a_column_and_a_line(tmp_path: Path) -> None:
    """CI's check of the newest published vLLM (``kvpush_tools.newest_vllm``) adds its tests as a column and its
    verdict under the table; a check that could not run adds the line alone."""
    (tmp_path / "lanes").write_text(LANES)
    junit(tmp_path / "main.xml", [("tests.test_vllm_compat", "test_range", "passed")])
    junit(tmp_path / "newest-vllm.xml", [("tests.unit.test_vllm_compat", "test_range", "failed")])
    line = "newest vLLM 0.35.0: incompatible because KVConnectorBase_V1.x is missing"
    (tmp_path / "newest-vllm.json").write_text(f'{{"version": "0.35.0", "status": "incompatible", "line": "{line}"}}')
    text = table(tmp_path, tmp_path / "lanes")
    assert "newest: vLLM 0.35.0 (its Python sources, main lane's packages)" in text
    assert rows(text)["vLLM compat and layouts (unit, real classes)"] == ["passed 1", "FAILED 1 of 1"]
    assert text.rstrip().endswith(f"Newest published vLLM (checked without a server): {line}")
    junit(tmp_path / "main.xml", [("tests.test_conformance", "test_host", "passed")])
    assert rows(table(tmp_path, tmp_path / "lanes"))["conformance (host backend)"] == [
        "passed 1",
        "not run (no server: sources only)",
    ]
    (tmp_path / "newest-vllm.json").write_text('{"version": "", "status": "not checked", "line": "newest vLLM: x"}')
    text = table(tmp_path, tmp_path / "lanes")
    assert "newest:" not in text and "(checked without a server): newest vLLM: x" in text
