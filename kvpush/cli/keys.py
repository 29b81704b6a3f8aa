"""``kvpush keys DIR``: make the side channel's key set (``docs/security.md``).

``kvpush keys DIR`` writes P's key pair and one D key pair that P allows; the
directory then serves both roles (a single host, a test, the demo). ``kvpush
keys DIR --decode NAME`` adds a D key pair of its own: ``DIR/NAME/`` is what
that D mounts, ``DIR/decoders/NAME.key`` is what P must see. The fence's keys
(``DIR/fence/``: D's fence listener pair, an operator pair D accepts) come with
the set, and on an older set with the next run. Existing keys are never
overwritten.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpush.core.errors import ConfigError
from kvpush.transport import key_set


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush keys", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("dir", help="key set directory (created if missing)")
    ap.add_argument(
        "--decode", action="append", default=[], metavar="NAME", help="add a D key pair of its own (repeatable)"
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=None,
        metavar="N",
        help="the D ranks (TP size times DP) of the D keys --decode makes: P lets such a key be known\n"
        "as at most 2 N D ranks (else peer_max_ranks)",
    )
    args = ap.parse_args(argv)
    try:
        made = key_set.make_key_set(args.dir)
        router = key_set.write_router_key(args.dir)
        made += [router] if router is not None else []
        own = [key_set.add_decode_key(args.dir, name, args.ranks) for name in args.decode]
    except (ConfigError, OSError) as exc:
        print(f"kvpush keys: {exc}", file=sys.stderr)
        return 1
    for path in made:
        print(f"made {path}")
    for path in own:
        print(f"made {path}/ (a D's mount: {key_set.PREFILL_PUBLIC}, {key_set.DECODE_SECRET}); P allows it")
    if not made and not own:
        print(f"{args.dir} already holds a key set; nothing changed")
    print(
        f"P: auth_keys_dir={args.dir} (reads {key_set.PREFILL_SECRET}, {key_set.DECODERS}/*.key)\n"
        f"D: auth_keys_dir={args.dir} or a {args.dir}/NAME made by --decode (reads {key_set.PREFILL_PUBLIC}, "
        f"{key_set.DECODE_SECRET})\n"
        f"router: --capability-key {args.dir}/{key_set.ROUTER_KEY} (kvpush router's concurrent dispatch mints "
        "each transfer's capability with it)\n"
        f"fence: a D with fence_port reads {key_set.FENCE_SECRET} and {key_set.OPERATORS}/*.key; `kvpush fence "
        f"--keys {args.dir}` reads {key_set.OPERATOR_SECRET} and {key_set.FENCE_PUBLIC}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
