"""The command-line options that shape every stack of a benchmark run alike, the same in every benchmark
(:func:`add_stack_arguments`, :func:`stack_options`), and the benchmarks' list options (``--qps 0.5,1``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class StackOptions:
    """What shapes every stack of a run alike: keyword arguments of ``stack_build.build_stack``."""

    p_cpus: str = "0"
    d_cpus: str = "1"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    debug_log: bool = False
    vllm_no_progress_thread: bool = False
    kvpush_extra: Mapping[str, Any] | None = None
    max_model_len: int | None = None
    prefill_args: tuple[str, ...] = ()
    kvpush_router_args: tuple[str, ...] = ()
    prefix_caching: bool = False
    server_env: Mapping[str, str] | None = None

    def kwargs(self) -> dict[str, Any]:
        return {
            "p_cpus": self.p_cpus,
            "d_cpus": self.d_cpus,
            "kv_cache_bytes": self.kv_cache_bytes,
            "debug_log": self.debug_log,
            "vllm_no_progress_thread": self.vllm_no_progress_thread,
            "kvpush_extra": self.kvpush_extra,
            "max_model_len": self.max_model_len,
            "prefill_args": self.prefill_args,
            "kvpush_router_args": self.kvpush_router_args,
            "prefix_caching": self.prefix_caching,
            "server_env": self.server_env,
        }


def comma_list(text: str, convert: Callable[[str], Any] = str) -> list[Any]:
    """``"a, b,,c"`` -> ``[convert("a"), convert("b"), convert("c")]``: the benchmarks' list options."""
    return [convert(x.strip()) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    """``--lengths 256,1024``-style options (argparse ``type=``)."""
    return comma_list(text, int)


def floats(text: str) -> list[float]:
    """``--qps 0.5,1``-style options (argparse ``type=``)."""
    return comma_list(text, float)


def add_stack_arguments(
    ap: argparse.ArgumentParser,
    *,
    model_dir: str = "models/tiny-qwen3",
    kv_cache_mib: int = 512,
    vllm_ablation: bool = True,
    debug_log: bool = True,
) -> None:
    """The command-line options of :class:`StackOptions` (and ``--model-dir``,
    ``--startup-timeout``), the same in every benchmark."""
    ap.add_argument("--model-dir", default=model_dir, help="where the tiny model is created (reused)")
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--kv-cache-mib", type=int, default=kv_cache_mib, help="KV cache per server (all modes alike)")
    if debug_log:
        ap.add_argument("--debug-log", action="store_true", help="KVPUSH_LOG_LEVEL=DEBUG on kvpush servers")
    ap.add_argument("--startup-timeout", type=float, default=1500.0)
    if vllm_ablation:
        ap.add_argument(
            "--vllm-no-progress-thread",
            action="store_true",
            help="ablation: vLLM's NIXL agents without their (spinning) progress thread; not a vLLM option",
        )
    ap.add_argument(
        "--kvpush-config",
        default=None,
        metavar="JSON",
        help="extra kv_connector_extra_config keys for kvpush, e.g. '{\"idle_poll_max_s\": 0.05}'",
    )


def stack_options(args: argparse.Namespace, **override: Any) -> StackOptions:
    """:class:`StackOptions` from the options of :func:`add_stack_arguments`."""
    opts: dict[str, Any] = {
        "p_cpus": args.prefill_cpus,
        "d_cpus": args.decode_cpus,
        "kv_cache_bytes": args.kv_cache_mib * 1024 * 1024,
        "debug_log": getattr(args, "debug_log", False),
        "vllm_no_progress_thread": getattr(args, "vllm_no_progress_thread", False),
        "kvpush_extra": json.loads(args.kvpush_config) if args.kvpush_config else None,
    }
    opts.update(override)
    return StackOptions(**opts)
