"""``kvpush timeline LOG [LOG...]``: join P's and D's ``kvpush.timeline`` log lines and show where time went.

The records, the join and the rendering are ``kvpush.observability.timeline``'s;
this module only reads the files and the arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.observability.timeline import draw_waterfall, join, parse_lines, render_table, summarize


def main(argv: Sequence[str] | None = None) -> int:
    """``kvpush timeline LOG [LOG...] [--png out.png]``: 0 when at least one transfer joined."""
    ap = argparse.ArgumentParser(
        prog="kvpush timeline",
        description="Join P's and D's kvpush.timeline log lines (KVPUSH_LOG_LEVEL=DEBUG) and show where time went.",
    )
    ap.add_argument("logs", nargs="+", type=Path, help="server logs (P's and D's; any order, any number)")
    ap.add_argument("--png", type=Path, help="write a waterfall of a sample of requests here")
    ap.add_argument("--sample", type=int, default=20, help="requests in the waterfall (default 20)")
    ap.add_argument("--top", type=int, default=20, help="slowest requests listed (default 20)")
    ap.add_argument("--json", type=Path, help="write the per-stage summary and joined transfers as JSON")
    a = ap.parse_args(argv)
    records: list[dict[str, Any]] = []
    bad = 0
    for path in a.logs:
        try:
            with open(path, errors="replace") as f:
                recs, b = parse_lines(f)
        except OSError as exc:
            print(f"kvpush timeline: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        records += recs
        bad += b
    joined, only_p, only_d = join(records)
    if bad:
        print(f"({bad} unreadable timeline lines skipped)")
    print(render_table(joined, only_p, only_d, a.top))
    if not joined:
        print(
            "no transfer appears in both P's and D's logs: start both servers with KVPUSH_LOG_LEVEL=DEBUG "
            "and give both logs",
            file=sys.stderr,
        )
        return 1
    if a.png is not None:
        n = draw_waterfall(joined, a.png, a.sample)
        print(f"waterfall of {n} transfers: {a.png}")
    if a.json is not None:
        payload = {
            "summary": summarize(joined),
            "transfers": [j.__dict__ for j in joined],
            "only_p": only_p,
            "only_d": only_d,
        }
        a.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
