"""The ``kvpush doctor`` command: its flags, the order the checks run in, and the exit status."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpush.doctor.clock import check_clock
from kvpush.doctor.device_backends import check_backends
from kvpush.doctor.efa import check_efa
from kvpush.doctor.nixl import check_libfabric, check_nixl, check_plugins, plugin_dir
from kvpush.doctor.port import check_port
from kvpush.doctor.report import Check, render, require, tally, write_json
from kvpush.doctor.selftest import self_test

DEFAULT_PLUGINS = ("UCX", "LIBFABRIC")
SELF_TEST_PLUGINS = ("UCX", "LIBFABRIC")
"""Plugins the self-test pushes through, each one that loads (unless ``--nixl-backend`` names one)."""

Say = Callable[[str], None]


def run(args: argparse.Namespace, progress: Say | None = None) -> list[Check]:
    """All checks, in order; ``progress`` hears about each slow one before it starts."""
    say = progress or (lambda _m: None)
    say("checking NIXL ...")
    nixl, wheel_dir = check_nixl()
    checks = [nixl]
    loaded: list[str] = []
    if nixl.status == "ok":
        loaded = _plugin_checks(checks, args.plugin or [], wheel_dir, say)
    checks.append(check_efa())
    say("loading kvpush backends ...")
    bchecks, usable = check_backends()
    checks += bchecks
    if args.self_test and nixl.status == "ok":
        checks += _self_tests(usable, args.nixl_backend, loaded, say)
    if args.port is not None:
        checks.append(check_port(args.host, args.port, args.tp_size))
    if args.peer:
        checks.append(check_clock(args.peer, args.max_skew_ms, args.auth_keys_dir or "", args.auth))
    return checks


def _plugin_checks(checks: list[Check], extra: Sequence[str], wheel_dir: str, say: Say) -> list[str]:
    """Append the plugin checks (and libfabric's providers) to ``checks``; return the plugins that load."""
    plugins = list(dict.fromkeys([*DEFAULT_PLUGINS, *extra]))
    say(f"starting a throwaway NIXL agent with {', '.join(plugins)} ...")
    pchecks = check_plugins(plugins, wheel_dir)
    checks += pchecks
    if "LIBFABRIC" in plugins:
        say("reading libfabric's providers ...")
        checks += check_libfabric(plugin_dir(wheel_dir))
    return [c.key for c in pchecks if c.status == "ok"]


def _self_tests(usable: dict[str, Any], nixl_backend: str | None, loaded: Sequence[str], say: Say) -> list[Check]:
    """A loopback push through every usable backend over each plugin that loads (or the one named)."""
    from kvpush.backends.registry import load_backend

    vias = [nixl_backend] if nixl_backend else [p for p in SELF_TEST_PLUGINS if p in loaded]
    checks: list[Check] = []
    if not vias:
        checks.append(
            Check("selftest", "self-test push", "fail", "skipped: no NIXL plugin loads", fix="see the plugins above")
        )
    for name, be in usable.items():
        be.close()  # the self-test makes its own P and D instances
        for i, via in enumerate(vias):
            say(f"self-test: pushing through the {name} backend over {via} ...")
            key = f"selftest:{name}" if i == 0 else f"selftest:{name}@{via}"
            checks.append(self_test(name, lambda n=name: load_backend(n), via, key=key))
    return checks


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush doctor",
        description="Check this host for kvpush: NIXL plugins, EFA, backends, a loopback push, port, clock.",
    )
    ap.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="NAME",
        help="fail (exit 1) unless NAME is ok: nixl, UCX, LIBFABRIC, efa, a backend (host, cuda, neuron), "
        "selftest:<backend> (repeatable)",
    )
    ap.add_argument("--plugin", action="append", metavar="NAME", help="also try this NIXL plugin (repeatable)")
    ap.add_argument("--nixl-backend", help="NIXL plugin for the self-test (default: UCX if it loads)")
    ap.add_argument("--no-self-test", dest="self_test", action="store_false", help="skip the loopback pushes")
    ap.add_argument("--port", type=int, help="check that this side-channel port (and port + rank) is free")
    ap.add_argument("--host", default="127.0.0.1", help="address the side channel binds to (with --port)")
    ap.add_argument("--tp-size", type=int, default=1, help="P ranks that bind port .. port + tp_size - 1")
    ap.add_argument("--peer", metavar="HOST:PORT", help="measure the clock offset to this P side channel")
    ap.add_argument("--max-skew-ms", type=float, default=5.0, help="clock offset that counts as a failure")
    ap.add_argument("--auth-keys-dir", help="D key set to authenticate to --peer with (default: $KVPUSH_AUTH_KEYS_DIR)")
    ap.add_argument(
        "--auth", choices=("curve", "none"), default="curve", help="none: --peer runs without authentication"
    )
    ap.add_argument("--json", type=Path, help="also write the findings as JSON here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when nothing failed, 1 when a check failed (or a required one is not ok), 2 on usage errors."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.peer and (":" not in args.peer or not args.peer.rpartition(":")[2].isdigit()):
        ap.error(f"--peer wants HOST:PORT, got {args.peer!r}")
    print(f"kvpush doctor on {platform.node()} (Python {platform.python_version()}, {platform.machine()})")
    progress = None if args.quiet else (lambda m: print(f"  ... {m.removesuffix(' ...')}", flush=True))
    checks = run(args, progress)
    require(checks, args.require)
    print(render(checks))
    print(tally(checks))
    if args.json is not None:
        write_json(checks, args.json)
    return 1 if any(c.status == "fail" for c in checks) else 0
