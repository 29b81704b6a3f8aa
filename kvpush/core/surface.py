"""What a dependency (vLLM, NIXL) offers kvpush, against what kvpush needs of it, and whether kvpush starts.

kvpush runs inside vLLM and drives NIXL, and both release more often than
kvpush does. Rule: a version newer than the newest one kvpush was tested with
starts, with one warning naming the tested range; kvpush refuses to start
only when something it needs is missing or changed (a hook vLLM calls, a
method kvpush calls, a field it reads), naming each, or when the version is
older than the oldest supported one. Reason: a hard upper bound refuses every
deployment on every new release until a kvpush release follows, while a
need that is missing or changed is exactly what would break, and can be
named at start instead of failing on the first request.

Everything here takes plain values: a dependency's *surface* (its classes'
members and their parameters, read by :func:`read_class`) and kvpush's
*needs* (:class:`Need`). The integrations hold the tables
(``kvpush.integrations.vllm.compat``, ``kvpush.transport.nixl_agent``).

Parameters are written as in a Python signature, ``self``/``cls`` left out:
``"x"`` (required), ``"x="`` (with a default), ``"*args"``, ``"*"`` (the
keyword-only marker), ``"**kwargs"``.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

Params = tuple[str, ...]
"""A callable's parameters (see the module docstring)."""

Members = Mapping[str, Params | None]
"""One class's members: a callable's name -> its ``Params``; a field, property, enum member or attribute its
``__init__`` assigns -> ``None``. The key ``ANY`` says the class's ``__init__`` could not be read, so
attributes it assigns may exist unlisted."""

Surface = Mapping[str, Members]
"""What a dependency offers: a class (under the name kvpush gives it) -> its members. A class missing from the
surface is missing from the dependency."""

ANY = "..."
"""A ``Members`` key: the class's ``__init__`` source could not be read (compiled code), so a field need of it
is taken as met rather than refused on a guess."""

Kind = Literal["hook", "call", "field"]


@dataclass(frozen=True)
class Need:
    """One thing kvpush needs of a dependency's class ``owner``, under one of ``names`` (the first is the name
    kvpush prefers; the others are what other versions call it).

    - ``hook``: the dependency calls kvpush's override of it: its parameters
      must be ``params`` (defaults aside), or the call would not fit;
    - ``call``: kvpush calls it with ``params`` positionally, then
      ``keywords``: its leading parameters must be named ``params`` (a
      reordered signature would take arguments in the wrong places) and it
      must need nothing more;
    - ``field``: kvpush reads it.

    ``optional``: a feature kvpush detects, so absence is fine, but a present
    one must fit. ``when``: needed only where that member (``"Class.member"``)
    exists. ``why`` says what kvpush uses it for, in the refusal.
    """

    owner: str
    names: tuple[str, ...]
    kind: Kind
    why: str
    params: Params = ()
    keywords: Params = ()
    optional: bool = False
    when: str = ""

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError(f"a need of {self.owner} names no member")
        if self.kind == "field" and (self.params or self.keywords):
            raise ValueError(f"field need {self.owner}.{self.names[0]} has parameters")

    @property
    def label(self) -> str:
        """``Owner.name``, or ``Owner.name (or other)`` where versions differ in the name."""
        alt = f" (or {', '.join(self.names[1:])})" if len(self.names) > 1 else ""
        return f"{self.owner}.{self.names[0]}{alt}"


def signature_text(params: Params) -> str:
    """``(a, b=, *, c)``: parameters as they read in a message."""
    return "(" + ", ".join(params) + ")"


def _names(params: Params) -> Params:
    return tuple(p.rstrip("=") for p in params)


def _fits_call(params: Params, positional: Params, keywords: Params) -> str:
    """Why calling a callable of ``params`` with ``positional`` then ``keywords`` would not fit ("" if it fits)."""
    star = next((i for i, p in enumerate(params) if p.startswith("*")), len(params))
    plain, rest = params[:star], params[star:]
    var_positional = any(p.startswith("*") and not p.startswith("**") and p != "*" for p in rest)
    var_keyword = any(p.startswith("**") for p in rest)
    if len(positional) > len(plain) and not var_positional:
        return f"takes {len(plain)} positional arguments, kvpush passes {len(positional)}"
    given = _names(plain[: len(positional)])
    if given != positional[: len(given)]:
        return f"its leading parameters are {signature_text(given)}, kvpush passes {signature_text(positional)}"
    left = [p for p in (*plain[len(positional) :], *rest) if not p.startswith("*")]
    required = [p for p in left if not p.endswith("=") and p not in keywords]
    if required:
        return f"it needs {', '.join(required)}, which kvpush does not pass"
    named = set(_names(tuple(left)))
    unknown = [k for k in keywords if k not in named]
    if unknown and not var_keyword:
        return f"it takes no {', '.join(unknown)}, which kvpush passes"
    return ""


def unmet(surface: Surface, needs: Sequence[Need]) -> list[str]:
    """Each need the surface does not meet, as a sentence naming the member and what changed (empty: all met)."""
    out: list[str] = []
    for need in needs:
        if need.when:
            owner, _, member = need.when.partition(".")
            if member not in surface.get(owner, {}):
                continue
        members = surface.get(need.owner)
        if members is None:
            if not need.optional:
                out.append(f"{need.label} is missing: there is no {need.owner} (kvpush {need.why})")
            continue
        present = [n for n in need.names if n in members]
        if not present:
            if need.kind == "field" and ANY in members:
                continue
            if not need.optional:
                out.append(f"{need.label} is missing (kvpush {need.why})")
            continue
        for name in present:
            problem = _problem(need, members[name])
            if problem:
                out.append(f"{need.owner}.{name} changed: {problem} (kvpush {need.why})")
    return out


def _problem(need: Need, params: Params | None) -> str:
    if need.kind == "field":
        return ""
    if params is None:
        return "it is no longer callable"
    if need.kind == "hook":
        if _names(params) != _names(need.params):
            return f"it takes {signature_text(params)}, kvpush's takes {signature_text(need.params)}"
        return ""
    return _fits_call(params, need.params, need.keywords)


def read_params(fn: Any) -> Params:
    """A callable's ``Params`` (``self``/``cls`` left out; a signature Python cannot read: ``(*args, **kwargs)``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ("*args", "**kwargs")
    out: list[str] = []
    star = False
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and p.name in ("self", "cls"):
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name + ("=" if p.default is not p.empty else ""))
    return tuple(out)


def init_assigns(cls: type) -> set[str] | None:
    """The attributes ``self.x`` that ``cls``'s ``__init__`` methods (its own and its bases') assign; None when a
    source cannot be read."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            return None
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def read_class(cls: type, *, instance: bool = False) -> dict[str, Params | None]:
    """``cls``'s ``Members``: its callables with their parameters, and its fields, properties, enum members and
    (``instance``) the attributes its ``__init__`` assigns. Names starting with ``__`` are left out but
    ``__init__``."""
    out: dict[str, Params | None] = {}
    for name in dir(cls):
        if name.startswith("__") and name != "__init__":
            continue
        try:
            static = inspect.getattr_static(cls, name)
            value = getattr(cls, name)
        except AttributeError:
            continue
        callable_ = callable(value) and not isinstance(static, property) and not _is_enum_member(cls, value)
        out[name] = read_params(value) if callable_ else None
    if is_dataclass(cls):
        for f in fields(cls):
            out.setdefault(f.name, None)
    if instance:
        assigned = init_assigns(cls)
        if assigned is None:
            out[ANY] = None
        for name in assigned or ():
            out.setdefault(name, None)
    return out


def _is_enum_member(cls: type, value: Any) -> bool:
    return isinstance(value, cls) and hasattr(cls, "__members__")


# ---------------- versions ----------------

Version = tuple[int, ...]


def parse_version(text: str) -> Version | None:
    """The leading numbers of a version string (``"0.34.0rc1"`` -> ``(0, 34, 0)``); None when there are none."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
    return tuple(int(x) for x in m[1].split(".")) if m else None


def version_text(version: Version) -> str:
    return ".".join(str(x) for x in version)


@dataclass(frozen=True)
class Versions:
    """The versions of a dependency kvpush was tested with, from ``oldest`` to ``newest``, compared at the
    precision each is written in (``(0, 34)``: every 0.34.x; ``(1, 5, 1)``: 1.5.1 and not 1.5.2). ``oldest``
    is also the oldest version kvpush supports."""

    product: str
    oldest: Version
    newest: Version

    def __post_init__(self) -> None:
        if not self.oldest or not self.newest or self.oldest > self.newest:
            raise ValueError(f"{self.product}: tested range {self.oldest} to {self.newest} is empty")

    @property
    def range_text(self) -> str:
        return f"{self.product} {version_text(self.oldest)} to {version_text(self.newest)}"

    def standing(self, version: str) -> Literal["older", "tested", "newer", "unreadable"]:
        """Where ``version`` stands against the tested range."""
        v = parse_version(version)
        if v is None:
            return "unreadable"
        if v[: len(self.oldest)] < self.oldest:
            return "older"
        if v[: len(self.newest)] > self.newest:
            return "newer"
        return "tested"


@dataclass(frozen=True)
class Verdict:
    """Whether kvpush starts on a dependency: ``refusal`` (non-empty: it does not, and this is why) or
    ``warning`` (non-empty: it starts and says this once)."""

    refusal: str = ""
    warning: str = ""


def start_verdict(tested: Versions, version: str, problems: Sequence[str], who: str = "kvpush") -> Verdict:
    """The start policy (see the module docstring): refuse a version older than ``tested.oldest``, and any
    version with ``problems`` (each need not met, named); warn once on a version newer than tested or
    unreadable; else start silently."""
    standing = tested.standing(version)
    if standing == "older":
        return Verdict(
            refusal=f"{who} supports {tested.product} {version_text(tested.oldest)} and later; this is "
            f"{tested.product} {version}: install a newer {tested.product}"
        )
    if problems:
        return Verdict(
            refusal=f"{who} cannot run on {tested.product} {version}: "
            + "; ".join(problems)
            + f" (tested with {tested.range_text})"
        )
    if standing == "newer":
        return Verdict(
            warning=f"{who} was tested with {tested.range_text}; this is {tested.product} {version}, newer: it "
            "starts because everything it needs of it is there (checked at start), but report what fails"
        )
    if standing == "unreadable":
        return Verdict(
            warning=f"{who} cannot read the version of this {tested.product} ({version!r}): tested with "
            f"{tested.range_text}; it starts because everything it needs of it is there (checked at start)"
        )
    return Verdict()
