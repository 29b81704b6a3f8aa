"""The test servers' KV-cache size (``servers.KV_CACHE_BYTES_ENV``): CI fits an e2e stream beside other lanes'
tests only if every server takes the smaller cache, and vLLM-CPU lets ``VLLM_CPU_KVCACHE_SPACE`` win over the flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpush_tools.demo import servers


def _server(tmp_path: Path, **kw: Any) -> Any:
    return servers.vllm_server("p", "/models/m", 8000, log_dir=tmp_path, **kw)


def test_the_size_reaches_every_server_and_the_legacy_variable_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(servers.KV_CACHE_BYTES_ENV, str(256 << 20))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    for kw in ({}, {"fast_start": True, "cpus": "0"}):
        s = _server(tmp_path, **kw)
        assert s.cmd[:3] == ["env", "-u", "VLLM_CPU_KVCACHE_SPACE"]
        assert s.cmd[s.cmd.index("--kv-cache-memory-bytes") + 1] == str(256 << 20)
        assert "VLLM_CPU_KVCACHE_SPACE" not in s.env


def test_a_size_the_caller_names_is_kept_and_unset_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(servers.KV_CACHE_BYTES_ENV, str(256 << 20))
    s = _server(tmp_path, extra_args=["--kv-cache-memory-bytes", "1000"])
    assert s.cmd.count("--kv-cache-memory-bytes") == 1 and s.cmd[-1] == "1000" and s.cmd[0] != "env"
    monkeypatch.delenv(servers.KV_CACHE_BYTES_ENV)
    s = _server(tmp_path)
    assert "--kv-cache-memory-bytes" not in s.cmd and s.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
