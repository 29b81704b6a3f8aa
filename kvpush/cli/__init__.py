"""The ``kvpush`` command: one entry point, subcommands dispatched lazily.

Each subcommand lives in its own module with a ``main(argv) -> int``; this
file only maps names to modules and imports the one asked for, so ``kvpush
--help`` stays fast and a subcommand whose module is not part of this install
says so instead of failing on import.
"""

from __future__ import annotations

import argparse
import importlib
import sys

INSTALL_HINTS = {
    "kvpush_tools": "; install the tooling beside the product: pip install -e tools",
    "aiohttp": "; install the router's extra: pip install 'kvpush[router]'",
}
"""What to install when a command's module (or what it imports) is missing."""

# name -> (module with main(argv), one-line help); "bench" has subcommands of its own.
COMMANDS: dict[str, tuple[str, str]] = {
    "conformance": ("kvpush.conformance.cli", "run the backend conformance suite against one backend"),
    "router": ("kvpush.integrations.router", "run the P/D router in front of vLLM servers"),
    "demo": ("kvpush_tools.demo.run", "run the end-to-end demo"),
    "doctor": ("kvpush.doctor", "check this host: NIXL plugins, devices, backends"),
    "keys": ("kvpush.cli.keys", "make the side channel's key set (P's pair, allowed D keys)"),
    "fence": ("kvpush.cli.fence", "declare P instances gone for good: every D gives back the blocks they withhold"),
    "timeline": ("kvpush.cli.timeline", "render a transfer timeline"),
}
BENCH: dict[str, tuple[str, str]] = {
    "transfer": ("kvpush_tools.bench.transfer", "benchmark pushes between two processes"),
    "serve": ("kvpush_tools.bench.serve", "TTFT/TPOT of kvpush vs vLLM's NIXL connectors under Poisson load"),
    "plot": ("kvpush_tools.bench.plot_serve", "summary table and TTFT/TPOT figures of a bench serve folder"),
    "idle": ("kvpush_tools.bench.idle", "CPU used by an idle P/D pair, per connector"),
    "auth": ("kvpush_tools.bench.auth", "side-channel round trips with and without CURVE authentication"),
    "seals": ("kvpush_tools.bench.seals", "what sealing and checking one NIXL notification costs P and D"),
    "post": (
        "kvpush_tools.bench.post",
        "P's post of a direct WRITE vs its descriptor count: per request, by index, vLLM's way",
    ),
    "soak": (
        "kvpush_tools.bench.soak",
        "a long run through vLLM with client aborts, P and D restarts and a network drop: errors, outputs, memory",
    ),
}


def _run(module: str, name: str, argv: list[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module.startswith(missing) or missing in INSTALL_HINTS):
            hint = INSTALL_HINTS.get(missing.split(".")[0], "")
            print(f"kvpush {name}: not available in this install ({missing} is missing){hint}", file=sys.stderr)
            return 2
        raise
    entry = getattr(mod, "main", None)
    if entry is None:
        print(f"kvpush {name}: {module} has no main(argv)", file=sys.stderr)
        return 2
    return int(entry(argv) or 0)


def _parser(prog: str, table: dict[str, tuple[str, str]]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<12} {h}" for n, (_, h) in table.items()),
    )
    ap.add_argument("command", choices=sorted(table), metavar="COMMAND")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (see kvpush COMMAND --help)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``kvpush COMMAND ...``; returns the command's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    table = {**COMMANDS, "bench": ("", "benchmarks: " + ", ".join(BENCH))}
    args = _parser("kvpush", table).parse_args(argv)
    if args.command == "bench":
        sub = _parser("kvpush bench", BENCH).parse_args(args.args)
        return _run(BENCH[sub.command][0], f"bench {sub.command}", sub.args)
    return _run(COMMANDS[args.command][0], args.command, args.args)
