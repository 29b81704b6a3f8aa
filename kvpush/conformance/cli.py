"""``kvpush conformance``: run the packaged conformance suite against one backend.

    kvpush conformance --backend NAME|module:Class [--devices 0,1] [--nixl-backend UCX]
                       [--option KEY=VALUE ...] [-- extra pytest args]

The suite is plain pytest (``kvpush.conformance.suite``) driven by the
``kvpush_conformance`` plugin's options; this command only fills them in, so
anything pytest accepts (``-k``, ``-x``, ``-v``, ``--durations``) goes after
``--``. The exit status is pytest's: 0 when every contract holds.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parent / "suite"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush conformance",
        description="Check that a kvpush backend keeps every contract the core relies on "
        "(describe, registration, byte-exact pushes through real NIXL between two processes, ordering, teardown).",
        epilog="Arguments after -- go to pytest, e.g. -- -x -k push -v",
    )
    ap.add_argument(
        "--backend", required=True, help="entry point in kvpush.backends (e.g. host, neuron, cuda), or module:Class"
    )
    ap.add_argument("--devices", default="0", help="device index for P and D, or P,D (e.g. 0,1); default 0")
    ap.add_argument("--nixl-backend", default="UCX", help="NIXL plugin(s) of the engines, comma-separated; default UCX")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend constructor option, repeatable (VALUE parsed as JSON when it parses, else a string)",
    )
    return ap


def pytest_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The pytest command line for ``args`` (exposed for tests and for running pytest yourself)."""
    out = [str(SUITE), f"--kvpush-backend={args.backend}", f"--kvpush-devices={args.devices}"]
    out += [f"--kvpush-nixl-backend={args.nixl_backend}", "-p", "no:cacheprovider"]
    # kvpush is imported before pytest starts, so pytest cannot rewrite it; that is expected here.
    out += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    out += [f"--kvpush-option={o}" for o in args.option]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        out += ["-p", "kvpush.conformance.plugin"]  # otherwise loaded through its pytest11 entry point
    return out + extra


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpush conformance``; returns pytest's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    from kvpush.conformance.target import parse_devices, parse_options, resolve_backend_class
    from kvpush.core.errors import ConfigError

    try:  # one clear message now rather than the same error from every test
        resolve_backend_class(args.backend)
        parse_options(args.option)
        parse_devices(args.devices)
    except ConfigError as exc:
        print(f"kvpush conformance: {exc}", file=sys.stderr)
        return 2
    import pytest

    return int(pytest.main(pytest_args(args, extra)))


if __name__ == "__main__":
    sys.exit(main())
