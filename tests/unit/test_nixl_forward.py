"""The start policy for NIXL versions newer than tested, against this lane's real NIXL API and stand-ins for a
future NIXL (``nixl_agent.check_nixl``).

A newer NIXL whose API fits every call kvpush makes starts with one warning naming the tested range (1.3.2 to
1.5.1); it is refused only where a call kvpush makes is missing or changed, naming it, or where a backend's
traits cannot be told on it. NIXL older than 1.3.2 is refused. The rule runs against this interpreter's NIXL
(each lane's: 1.3.2, 1.4.1, 1.5.1), and an agent really starts (UCX) under a made-up newer version.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers_logs import kvpush_warnings

from kvpush.core.errors import KVPushError
from kvpush.core.surface import Verdict, read_class
from kvpush.transport import nixl_agent
from kvpush.transport.nixl_agent import Agent, check_nixl, nixl_version, read_nixl_surface

pytest.importorskip("nixl")

FUTURE = "1.9.0"


def surface() -> dict[str, dict[str, Any]]:
    return {k: dict(v) for k, v in read_nixl_surface().items()}


@pytest.fixture(autouse=True)
def _forget_warnings() -> Any:
    nixl_agent.warn_once.cache_clear()
    yield
    nixl_agent.warn_once.cache_clear()


def test_this_nixl_meets_every_need_and_is_tested() -> None:
    assert check_nixl(nixl_version(), read_nixl_surface(), ("UCX", "LIBFABRIC")) == Verdict()


@pytest.mark.parametrize("version", ["1.5.2", "1.6.0", "2.0.0+cu13"])
def test_a_newer_nixl_starts_with_a_warning_naming_the_tested_range(version: str) -> None:
    verdict = check_nixl(version, read_nixl_surface(), ("UCX", "LIBFABRIC"))
    assert verdict.refusal == ""
    assert f"tested with NIXL 1.3.2 to 1.5.1; this is NIXL {version}, newer" in verdict.warning


def test_an_agent_starts_on_a_newer_nixl_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accepted case runs: two UCX agents start and exchange a notification under NIXL "1.9.0"."""
    monkeypatch.setattr(nixl_agent, "nixl_version", lambda: FUTURE)
    with kvpush_warnings() as said:
        a, b = Agent("fwd-a"), Agent("fwd-b")
    warned = [line for line in said if "this is NIXL 1.9.0, newer" in line]
    assert len(warned) == 1 and "tested with NIXL 1.3.2 to 1.5.1" in warned[0]
    assert a.nixl_version == FUTURE
    try:
        name = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        a.send_notif(name, b"hello")
        deadline = time.monotonic() + 20
        got: list[tuple[str, bytes]] = []
        while not got and time.monotonic() < deadline:
            a.progress()
            got = b.notifs()
        assert [m for _, m in got] == [b"hello"]
    finally:
        a.close()
        b.close()


def test_an_older_nixl_is_refused() -> None:
    verdict = check_nixl("1.3.1", read_nixl_surface(), ("UCX",))
    assert "supports NIXL 1.3.2 and later; this is NIXL 1.3.1" in verdict.refusal


@pytest.mark.parametrize("method", ["transfer", "make_prepped_xfer", "get_new_notifs"])
def test_a_call_removed_is_refused_naming_it(method: str) -> None:
    s = surface()
    s["nixl_agent"].pop(method)
    assert f"nixl_agent.{method} is missing" in check_nixl(FUTURE, s, ("UCX",)).refusal


def test_a_call_whose_signature_changed_is_refused_naming_it() -> None:
    """A future NIXL that takes ``transfer``'s notification first would get kvpush's handle there."""

    class FutureAgent:
        def transfer(self, notif_msg: bytes, handle: Any) -> Any: ...

        def get_reg_descs(self, descs: Any, mem_type: str, device: int) -> Any: ...

    s = surface()
    s["nixl_agent"].update(read_class(FutureAgent))
    got = check_nixl(FUTURE, s, ("UCX",)).refusal
    assert "nixl_agent.transfer changed: its leading parameters are (notif_msg, handle)" in got
    assert "nixl_agent.get_reg_descs changed: it needs device, which kvpush does not pass" in got


def test_a_config_without_the_thread_switches_is_refused() -> None:
    s = surface()
    s["nixl_agent_config"] = {"__init__": ("backends=",)}
    assert "nixl_agent_config.__init__ changed: it takes no enable_prog_thread" in check_nixl(FUTURE, s, ()).refusal


def test_a_backend_whose_traits_cannot_be_told_is_refused_on_a_newer_nixl_only() -> None:
    assert "cannot tell how to drive NIXL backend GDS" in check_nixl(FUTURE, read_nixl_surface(), ("GDS",)).refusal
    assert "GDS" in check_nixl("unknown", read_nixl_surface(), ("UCX", "GDS")).refusal
    assert check_nixl("1.5.1", read_nixl_surface(), ("GDS",)).refusal == ""  # driven as UCX, as before


def test_agent_start_refuses_naming_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_agent, "nixl_version", lambda: "1.2.0")
    with pytest.raises(KVPushError, match=r"supports NIXL 1\.3\.2 and later; this is NIXL 1\.2\.0.*pip install"):
        Agent("fwd-old")
