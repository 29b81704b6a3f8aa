"""Ablation for ``kvpush bench serve/idle --vllm-no-progress-thread``: NIXL agents without their progress thread.

Put on ``PYTHONPATH`` of vLLM's servers only. vLLM's NIXL connectors create
their agent with NIXL's default progress thread, which NIXL's Python API
starts with ``pthrDelay = 0``: it polls UCX without sleeping, a core per
agent. This hook makes every ``nixl_agent_config`` ask for no progress
thread, so UCX progresses only inside the connector's own NIXL calls (which
vLLM makes every engine step). It exists to answer one question honestly:
how much of kvpush's lead is the spinning thread, and how much is the rest.
It is an experiment, not a supported vLLM configuration.

The patch is applied lazily when ``nixl._api`` is imported (importing it
here would load torch into every Python process of the server tree).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any


def _patch(module: Any) -> None:
    cls = module.nixl_agent_config
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.enable_pthread = False

    cls.__init__ = __init__
    print("kvpush ablation: NIXL agents without progress thread", file=sys.stderr, flush=True)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        # ``nixl`` is a meta package: the real module is nixl_cu12._api / nixl_cu13._api.
        if not (name.startswith("nixl") and name.endswith("._api")):
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module: Any) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = patched_exec  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Hook())
