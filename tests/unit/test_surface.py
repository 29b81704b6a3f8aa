"""The start policy for dependency versions newer than tested, and the needs-against-surface rule (no vLLM, no NIXL).

Stand-in classes play a dependency; ``read_class`` reads them as it reads vLLM's and NIXL's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import pytest

from kvpush.core.surface import (
    ANY,
    Need,
    Versions,
    parse_version,
    read_class,
    read_params,
    signature_text,
    start_verdict,
    unmet,
)


class Base:
    def __init__(self, config: Any, role: Any) -> None:
        self.config = config
        self._meta: Any = None

    def finished(self, request: Any, block_ids: Any) -> None: ...

    def load(self, context: Any, **kwargs: Any) -> None: ...

    @classmethod
    def build(cls, data: Any = None) -> None: ...

    def post(self, handle: Any, notif: bytes = b"", *, backends: Any = None) -> None: ...

    @property
    def ready(self) -> bool:
        return True


@dataclass
class Output:
    done: set[str]
    failed: set[str] | None = None


class Status(Enum):
    STOPPED = 1


def test_read_params_writes_a_signature_as_python_does() -> None:
    def f(a: int, b: int = 1, *args: Any, c: int, d: int = 2, **kw: Any) -> None: ...

    def g(a: int, *, c: int) -> None: ...

    assert read_params(f) == ("a", "b=", "*args", "c", "d=", "**kw")
    assert read_params(g) == ("a", "*", "c")
    assert read_params(Base.finished) == ("request", "block_ids")  # self left out
    assert read_params(Base.build) == ("data=",)  # cls left out
    assert read_params(len) == ("obj",) or read_params(len) == ("*args", "**kwargs")
    assert signature_text(("a", "*", "c=")) == "(a, *, c=)"


def test_read_class_reads_methods_fields_properties_enum_members_and_init_attributes() -> None:
    m = read_class(Base, instance=True)
    assert m["finished"] == ("request", "block_ids")
    assert m["load"] == ("context", "**kwargs")
    assert m["ready"] is None and m["config"] is None and m["_meta"] is None
    assert m["__init__"] == ("config", "role")
    assert "_meta" not in read_class(Base)  # instance attributes only when asked
    assert read_class(Output)["done"] is None and read_class(Output)["failed"] is None
    assert read_class(Status)["STOPPED"] is None


def test_an_init_whose_source_cannot_be_read_lets_field_needs_pass() -> None:
    """A compiled ``__init__`` hides the attributes it assigns: a field need of the class is not refused on a guess
    (``ANY``), while its methods are still checked."""
    compiled = type("Compiled", (), {"__init__": lambda self: None})
    compiled.__init__.__code__ = compile("lambda self: None", "<no source>", "eval").co_consts[0]
    m = read_class(compiled, instance=True)
    assert ANY in m
    needs = [Need("C", ("anything",), "field", "reads it"), Need("C", ("go",), "call", "calls it")]
    assert unmet({"C": m}, needs) == ["C.go is missing (kvpush calls it)"]


SURFACE = {"Base": read_class(Base, instance=True), "Output": read_class(Output), "Status": read_class(Status)}


@pytest.mark.parametrize(
    ("need", "problem"),
    [
        (Need("Base", ("finished",), "hook", "holds blocks", ("request", "block_ids")), ""),
        (
            Need("Base", ("finished",), "hook", "holds blocks", ("request",)),
            "Base.finished changed: it takes (request, block_ids), kvpush's takes (request) (kvpush holds blocks)",
        ),
        (Need("Base", ("gone",), "hook", "x"), "Base.gone is missing (kvpush x)"),
        (Need("Base", ("gone",), "hook", "x", optional=True), ""),
        (Need("Base", ("gone", "finished"), "hook", "x", ("request", "block_ids")), ""),
        (Need("Base", ("gone", "other"), "field", "x"), "Base.gone (or other) is missing (kvpush x)"),
        (Need("Nope", ("a",), "field", "x"), "Nope.a is missing: there is no Nope (kvpush x)"),
        (Need("Nope", ("a",), "field", "x", optional=True), ""),
        (Need("Base", ("post",), "call", "x", ("handle", "notif")), ""),
        (Need("Base", ("post",), "call", "x", ("handle",), ("backends",)), ""),
        (
            Need("Base", ("post",), "call", "x", ("notif", "handle")),
            "Base.post changed: its leading parameters are (handle, notif), kvpush passes (notif, handle) (kvpush x)",
        ),
        (
            Need("Base", ("post",), "call", "x", ("handle", "notif", "backends")),
            "Base.post changed: takes 2 positional arguments, kvpush passes 3 (kvpush x)",
        ),
        (
            Need("Base", ("post",), "call", "x", ("handle",), ("ttl",)),
            "Base.post changed: it takes no ttl, which kvpush passes (kvpush x)",
        ),
        (
            Need("Base", ("finished",), "call", "x", ("request",)),
            "Base.finished changed: it needs block_ids, which kvpush does not pass (kvpush x)",
        ),
        (Need("Base", ("ready",), "call", "x"), "Base.ready changed: it is no longer callable (kvpush x)"),
        (Need("Base", ("load",), "call", "x", ("context",), ("anything",)), ""),  # **kwargs takes any keyword
        (Need("Output", ("failed",), "field", "x"), ""),
        (Need("Status", ("STOPPED",), "field", "x"), ""),
        (Need("Status", ("CAPPED",), "field", "x"), "Status.CAPPED is missing (kvpush x)"),
        (Need("Output", ("extra",), "field", "x", when="Base.gone"), ""),  # needed only where Base.gone exists
        (Need("Output", ("extra",), "field", "x", when="Base.ready"), "Output.extra is missing (kvpush x)"),
    ],
)
def test_unmet_names_each_need_and_what_changed(need: Need, problem: str) -> None:
    assert unmet(SURFACE, [need]) == ([problem] if problem else [])


def test_every_present_alternative_must_fit() -> None:
    """kvpush implements both names of a renamed hook, so where vLLM has both, both must fit."""

    class Both(Base):
        def gone(self, request: Any) -> None: ...

    need = Need("Base", ("gone", "finished"), "hook", "x", ("request", "block_ids"))
    assert unmet({"Base": read_class(Both)}, [need]) == [
        "Base.gone changed: it takes (request), kvpush's takes (request, block_ids) (kvpush x)"
    ]


def test_a_need_must_name_a_member() -> None:
    with pytest.raises(ValueError, match="names no member"):
        Need("Base", (), "field", "x")
    with pytest.raises(ValueError, match="has parameters"):
        Need("Base", ("a",), "field", "x", ("b",))


VLLM = Versions("vLLM", (0, 24), (0, 34))
NIXL = Versions("NIXL", (1, 3, 2), (1, 5, 1))


@pytest.mark.parametrize(
    ("tested", "version", "standing"),
    [
        (VLLM, "0.23.9", "older"),
        (VLLM, "0.24.0", "tested"),
        (VLLM, "0.34.0rc1", "tested"),
        (VLLM, "0.34.7", "tested"),  # a minor is tested as a whole
        (VLLM, "0.35.0", "newer"),
        (VLLM, "1.0", "newer"),
        (VLLM, "0.34.1.dev12+gabc", "tested"),
        (VLLM, "dev", "unreadable"),
        (VLLM, "", "unreadable"),
        (NIXL, "1.3.1", "older"),
        (NIXL, "1.3.2", "tested"),
        (NIXL, "1.5.1", "tested"),
        (NIXL, "1.5.2", "newer"),  # a patch is compared as a patch
        (NIXL, "1.6.0+cu12", "newer"),
        (NIXL, "unknown", "unreadable"),
    ],
)
def test_standing(tested: Versions, version: str, standing: str) -> None:
    assert tested.standing(version) == standing


def test_parse_version() -> None:
    assert parse_version("0.34.0rc1") == (0, 34, 0)
    assert parse_version("v1.5") == (1, 5)
    assert parse_version("unknown") is None
    with pytest.raises(ValueError, match="empty"):
        Versions("x", (2,), (1,))


def test_start_verdict_is_the_forward_policy() -> None:
    """Versions: silent. Newer or unreadable: one warning naming the tested range. Older: refused. A need unmet:
    refused on any version, naming it."""
    assert start_verdict(VLLM, "0.32.0", []) == start_verdict(VLLM, "0.24.1", [])
    assert start_verdict(VLLM, "0.32.0", []).refusal == start_verdict(VLLM, "0.32.0", []).warning == ""
    newer = start_verdict(VLLM, "0.35.0", [], who="KVPushConnector")
    assert newer.refusal == "" and "KVPushConnector was tested with vLLM 0.24 to 0.34" in newer.warning
    assert "this is vLLM 0.35.0, newer" in newer.warning
    assert "cannot read" in start_verdict(VLLM, "dev", []).warning
    older = start_verdict(VLLM, "0.23.0", [])
    assert older.warning == "" and "supports vLLM 0.24 and later; this is vLLM 0.23.0" in older.refusal
    for version in ("0.32.0", "0.35.0", "dev"):
        refused = start_verdict(VLLM, version, ["A.b is missing (kvpush x)", "C.d changed: y"])
        assert refused.warning == ""
        assert refused.refusal.startswith(f"kvpush cannot run on vLLM {version}: A.b is missing (kvpush x); C.d")
        assert refused.refusal.endswith("(tested with vLLM 0.24 to 0.34)")
