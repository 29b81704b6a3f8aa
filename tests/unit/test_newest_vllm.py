"""CI's check of the newest published vLLM: reading the registry's answer and the verdict line (no registry)."""

from __future__ import annotations

from kvpush_tools.newest_vllm import RunResults, newest_version, verdict

INDEX = """WARNING: pip index is currently an experimental command.
vllm (0.34.0)
Available versions: 0.34.0, 0.33.0, 0.32.0
"""


def test_newest_version_is_read_from_pips_answer() -> None:
    assert newest_version(INDEX) == "0.34.0"
    assert newest_version("vllm (0.35.0rc1)\n") == "0.35.0rc1"
    assert newest_version("ERROR: No matching distribution found for vllm") is None
    assert newest_version("") is None


OK_PROBE = {"version": "0.35.0", "refusal": "", "warning": "KVPushConnector was tested with ...", "unknown_layouts": []}


def test_compatible_says_how_it_starts_and_what_ran() -> None:
    r = verdict("0.35.0", probe=OK_PROBE, tests=RunResults(passed=130, skipped=4))
    assert r.status == "compatible"
    assert r.line == (
        "newest vLLM 0.35.0: compatible: KVPushConnector starts with the newer-than-tested warning; unit tests "
        "against its classes passed 130 (+4 skipped)"
    )
    tested = verdict("0.34.0", probe={**OK_PROBE, "warning": ""}, tests=RunResults(passed=1))
    assert "starts (within the tested range)" in tested.line
    layouts = verdict("0.35.0", probe={**OK_PROBE, "unknown_layouts": ["LBNCH"]}, tests=RunResults(passed=1))
    assert layouts.status == "compatible" and "layouts kvpush does not know (LBNCH), refused if chosen" in layouts.line


def test_incompatible_names_the_refusal_and_the_failed_tests() -> None:
    probe = {**OK_PROBE, "refusal": "KVPushConnector cannot run on vLLM 0.35.0: KVConnectorBase_V1.x is missing"}
    failed = [f"test_vllm_compat::test_{i}" for i in range(7)]
    r = verdict("0.35.0", probe=probe, tests=RunResults(passed=3, failed=failed))
    assert r.status == "incompatible"
    assert r.line.startswith("newest vLLM 0.35.0: incompatible because KVPushConnector cannot run on vLLM 0.35.0: ")
    assert "KVConnectorBase_V1.x is missing; 7 unit tests fail against its classes: test_vllm_compat::test_0" in r.line
    assert r.line.endswith("test_vllm_compat::test_4 and 2 more")
    only_tests = verdict("0.35.0", probe=OK_PROBE, tests=RunResults(failed=["a::b"]))
    assert only_tests.line == "newest vLLM 0.35.0: incompatible because 1 unit tests fail against its classes: a::b"


def test_what_could_not_run_is_said_not_failed() -> None:
    assert verdict(None, "the registry did not answer in 60 s").line == (
        "newest vLLM: not checked here: the registry did not answer in 60 s"
    )
    r = verdict("0.35.0", probe={"error": "its Python sources do not import over this interpreter's packages"})
    assert r.status == "not checked" and "0.35.0: not checked here: its Python sources do not import" in r.line
    assert verdict("0.35.0", "downloading took over 300 s").status == "not checked"
