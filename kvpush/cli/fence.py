"""``kvpush fence``: declare P instances gone for good, so every D gives back the blocks they withhold.

D never gives back the blocks of a P it declared dead on a timer: a P only frozen (SIGSTOP, a debugger, a VM
migration) may still WRITE them. Once the orchestrator knows a P is gone for good (its process killed, its
pod deleted), it or an operator runs this against every D (``--decode``: each D engine's ``fence_port``).
Each D ends the transfers those P ranks were to write (waiting ones fail now) and gives their blocks back to
vLLM. Fence only a P that cannot run again: fencing a frozen one lets it corrupt other requests' KV when it
resumes. Authenticated with the operator's key pair of the key set (``fence/operator.key_secret``; D accepts
the keys in its ``fence/operators/``): docs/security.md, "Fencing a P for good".

Exit status 0 when every D accepted the fence, 1 otherwise (each D's answer is printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpush.core.errors import ConfigError
from kvpush.decode.fence import FenceRequest, encode_request, parse_targets
from kvpush.transport.fence_channel import send_fence
from kvpush.transport.key_set import FenceClientKeys, fence_client_keys, keys_dir


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvpush fence", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="HOST:PORT[/TP]",
        help="a P instance gone for good: its side channel (rank 0's port, as D was told) and TP size (repeatable)",
    )
    ap.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a D engine's fence listener (its fence_port; DP engine k listens on fence_port + k) (repeatable)",
    )
    ap.add_argument("--keys", default="", metavar="DIR", help="key set holding fence/ (default $KVPUSH_AUTH_KEYS_DIR)")
    ap.add_argument("--no-auth", action="store_true", help='for D engines running with "auth": "none" only')
    ap.add_argument("--reason", default="", help="why (each D logs it)")
    ap.add_argument("--timeout", type=float, default=10.0, metavar="S", help="how long to wait for each D (10)")
    args = ap.parse_args(argv)
    try:
        targets = parse_targets(args.prefill)
        if not args.decode:
            raise ConfigError("--decode: name at least one D fence listener (HOST:FENCE_PORT)")
        keys: FenceClientKeys | None = None
        if not args.no_auth:
            root = keys_dir(args.keys)
            if root is None:
                raise ConfigError("no key set: pass --keys DIR (or set $KVPUSH_AUTH_KEYS_DIR), or --no-auth")
            keys = fence_client_keys(root)
    except ConfigError as exc:
        print(f"kvpush fence: {exc}", file=sys.stderr)
        return 2
    reason = args.reason or "kvpush fence"
    request = encode_request(FenceRequest(targets, reason))
    failed = 0
    for address in args.decode:
        ok, said = send_fence(address, request, keys, args.timeout)
        print(f"D {address}: {'ok' if ok else 'FAILED'}: {said}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
