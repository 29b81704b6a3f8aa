"""The router against small in-process stand-ins for vLLM.

The stand-ins record what they receive (bodies, headers, arrival and finish
times, whether the router hung up on them) so these tests check the router's
own behaviour: concurrency of P and D, one transfer id for both, D's stream
passed through byte for byte, least-loaded choice, and failures that become
fast, clear HTTP errors. The real-vLLM path is the e2e test's job.

Tests are plain functions running ``asyncio.run`` so they need no async
pytest plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpush.integrations.router import (
    Instance,
    Pool,
    Router,
    RouterConfig,
    concurrent,
    config_from_args,
    decode_body,
    decode_params,
    dp_engines,
    prefill_body,
)

STREAM_CHUNKS = [
    b'data: {"id":"x","choices":[{"index":0,"text":" alpha"}]}\n\n',
    b'data: {"id":"x","choices":[{"index":0,"te',  # an event split across chunks
    b'xt":" beta\xc3',  # and a UTF-8 character split too
    b'\xa9"}]}\n\ndata: {"id":"x","choices":[{"index":0,"text":" gamma","finish_reason":"length"}]}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Seen:
    """One request as an upstream stand-in received it."""

    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]  # case-insensitive, as received
    t_arrive: float
    t_finish: float | None = None
    disconnected: bool = False
    conn: int = 0  # the router's end of the connection it came on (its port)


@dataclass
class Upstream:
    """A vLLM stand-in. ``behavior`` may be changed between requests."""

    role: str
    delay: float = 0.05  # before answering (P) / before the first byte (D)
    status: int = 200
    # ok | hang | cut (streams ``cut_after`` chunks, then drops the connection) | short (then ends the stream
    # cleanly, without its last event) | drop (drops the connection instead of answering)
    behavior: str = "ok"
    cut_after: int = 1
    health: int = 200
    health_delay: float = 0.0  # before answering /health (a busy server)
    engine_id: str = "p-engine"
    waiting: int = 0  # what its /metrics reports as vllm:num_requests_waiting
    engine_waiting: dict[int, int] = field(default_factory=dict)  # data parallel: per engine (DP rank)
    seen: list[Seen] = field(default_factory=list)
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _metrics(self, _r: web.Request) -> web.Response:
        waiting = self.engine_waiting or {0: self.waiting}
        text = "".join(f'vllm:num_requests_waiting{{engine="{k}"}} {n}.0\n' for k, n in waiting.items())
        text += "".join(f'vllm:num_requests_running{{engine="{k}"}} 0.0\n' for k in waiting)
        return web.Response(text=text)

    async def _health(self, _r: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay)
        return web.json_response({}, status=self.health)

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.role}]})

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        seen = Seen(req.path, await req.json(), req.headers.copy(), time.monotonic())
        peer = req.transport.get_extra_info("peername") if req.transport is not None else None
        seen.conn = peer[1] if peer else 0
        self.seen.append(seen)
        try:
            if self.behavior == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay)
            if self.behavior == "drop":  # the instance dies with the request in hand
                assert req.transport is not None
                req.transport.close()
                return web.Response()
            if self.status != 200:
                return web.json_response({"error": {"message": f"{self.role} says no"}}, status=self.status)
            if self.role == "prefill":
                params = {
                    "do_remote_prefill": True,
                    "remote_engine_id": self.engine_id,
                    "remote_block_ids": [[1, 2, 3]],
                    "remote_host": "10.0.0.1",
                    "remote_port": 5601,
                    "tp_size": 1,
                }
                prompt = seen.body.get("prompt")
                tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
                usage = {"prompt_tokens": tokens}
                return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params, "usage": usage})
            if seen.body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(req)
                for k, chunk in enumerate(STREAM_CHUNKS, 1):
                    await resp.write(chunk)
                    await asyncio.sleep(0.01)
                    if self.behavior == "cut" and k == self.cut_after:  # D dies mid-stream
                        assert req.transport is not None
                        req.transport.close()
                        return resp
                    if self.behavior == "short" and k == self.cut_after:
                        break
                await resp.write_eof()
                return resp
            return web.json_response({"choices": [{"text": "decoded", "index": 0}], "served_by": self.url})
        except asyncio.CancelledError:
            seen.disconnected = True
            raise
        finally:
            seen.t_finish = time.monotonic()


def closed_port_url() -> str:
    """A URL where nothing listens (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class Cluster:
    router: Router
    url: str
    session: aiohttp.ClientSession
    p: list[Upstream]
    d: list[Upstream]

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes, float]:
        t0 = time.monotonic()
        async with self.session.post(self.url + path, json=body) as r:
            data = await r.read()
            return r.status, data, time.monotonic() - t0

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as r:
            return r.status, await r.json(content_type=None)


@contextlib.asynccontextmanager
async def cluster(
    n_p: int = 1,
    n_d: int = 1,
    mode: str = "kvpush",
    dead_p: int = 0,
    dead_d: int = 0,
    engine_ids: bool = True,
    p_dp: int = 1,
    d_dp: int = 1,
    p_tp: int = 1,
    server_keepalive: float = 75.0,
    **cfg: Any,
) -> AsyncIterator[Cluster]:
    """Upstream stand-ins (the first ``dead_*`` of each role are URLs where
    nothing listens) and a router in front of them; ``p_dp``/``d_dp``: each
    stand-in is one server of that many data-parallel engines; ``server_keepalive``:
    how long a stand-in keeps an idle connection open (aiohttp's default)."""
    ups_p = [Upstream("prefill") for _ in range(n_p)]
    ups_d = [Upstream("decode") for _ in range(n_d)]
    servers = []
    for u in ups_p + ups_d:
        u.server = TestServer(u.app(), handler_cancellation=True, keepalive_timeout=server_keepalive)
        await u.server.start_server()
        servers.append(u.server)
    p_urls = [closed_port_url() for _ in range(dead_p)] + [u.url for u in ups_p]
    d_urls = [closed_port_url() for _ in range(dead_d)] + [u.url for u in ups_d]
    prefill = [
        Instance(u, "prefill", "127.0.0.1", 5600 + i, p_tp, f"engine-{i}" if engine_ids else None)
        for i, u in enumerate(p_urls)
    ]
    decode = [Instance(u, "decode") for u in d_urls]
    prefill = [e for i in prefill for e in dp_engines(i, p_dp, mode)]
    decode = [e for i in decode for e in dp_engines(i, d_dp, mode)]
    cfg.setdefault("health_interval", 0)
    router = Router(RouterConfig(prefill=prefill, decode=decode, mode=mode, **cfg))
    rserver = TestServer(router.app(), handler_cancellation=True)
    await rserver.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            yield Cluster(router, str(rserver.make_url("")).rstrip("/"), session, ups_p, ups_d)
    finally:
        await rserver.close()
        for s in servers:
            await s.close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


COMPLETION = {"model": "tiny", "prompt": "the world", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


# --------------------------------------------------------------------------- #
# Pure selection and parameter building.
# --------------------------------------------------------------------------- #


def test_pool_picks_least_loaded_then_rotates_ties() -> None:
    a, b, c = (Instance(f"http://h{i}", "decode") for i in range(3))
    pool = Pool([a, b, c])
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert pool.pick() is b
    a.in_flight = b.in_flight = c.in_flight = 0
    assert [pool.pick() for _ in range(4)] == [c, a, b, c]  # cursor continues after b
    b.healthy = False
    assert pool.pick(exclude=[c]) is a
    a.healthy = c.healthy = False
    assert pool.pick() is None


def test_prefill_body_cuts_to_one_token_and_tags_transfer() -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4}
    out = prefill_body(body, "kvpush", "t1")
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "t1"}
    assert body["stream"] is True and "kv_transfer_params" not in body  # the client's body is untouched
    chat = prefill_body(CHAT, "kvpush", "t1")
    assert chat["max_tokens"] == 1 and chat["max_completion_tokens"] == 1
    pull = prefill_body(COMPLETION, "vllm-pull", "t1")["kv_transfer_params"]
    assert pull["do_remote_decode"] is True and pull["do_remote_prefill"] is False
    assert pull["remote_engine_id"] is None and pull["remote_block_ids"] is None
    with pytest.raises(ValueError, match="mode"):
        prefill_body(COMPLETION, "nope", "t1")


def test_decode_params_per_mode() -> None:
    p = Instance("http://p", "prefill", "10.1.1.1", 5600, 2, "eng-7")
    assert decode_params("kvpush", "t9", p) == {
        "do_remote_prefill": True,
        "transfer_id": "t9",
        "remote_host": "10.1.1.1",
        "remote_port": 5600,
        "remote_tp_size": 2,
    }
    returned = {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[4]], "remote_engine_id": "e"}}
    assert decode_params("vllm-pull", "t9", p, returned) == returned["kv_transfer_params"]
    with pytest.raises(ValueError, match="no kv_transfer_params"):
        decode_params("vllm-pull", "t9", p, {"choices": []})
    push = decode_params("vllm-push", "t9", p)
    assert push["remote_engine_id"] == "eng-7" and push["do_remote_prefill"] is True
    assert (push["remote_host"], push["remote_port"], push["tp_size"]) == ("10.1.1.1", 5600, 2)
    assert push["remote_request_id"] == "t9"
    unknown = Instance("http://p", "prefill", "10.1.1.1", 5600)
    assert not concurrent("vllm-push", unknown) and concurrent("vllm-push", p) and concurrent("kvpush", unknown)
    with pytest.raises(ValueError, match="engine id"):
        decode_params("vllm-push", "t9", unknown)
    learned = decode_params("vllm-push", "t9", unknown, {"kv_transfer_params": {"remote_engine_id": "learned"}})
    assert learned["remote_engine_id"] == "learned"
    assert not concurrent("vllm-pull", p)
    d = decode_body({**COMPLETION, "kv_transfer_params": {"junk": 1}}, {"x": 1})
    assert d["kv_transfer_params"] == {"x": 1} and d["prompt"] == COMPLETION["prompt"]


def test_cli_pairs_prefill_options_in_order() -> None:
    cfg = config_from_args(
        [
            "--prefill=http://a:1",
            "--prefill-kv=10.0.0.1:5600",
            "--prefill=http://b:1/",
            "--prefill-kv=10.0.0.2:5601",
            "--prefill-tp=2",
            "--decode=http://c:1",
            "--decode=http://d:1",
        ]
    )
    assert [(i.url, i.kv_host, i.kv_port, i.tp_size) for i in cfg.prefill] == [
        ("http://a:1", "10.0.0.1", 5600, 2),
        ("http://b:1", "10.0.0.2", 5601, 2),
    ]
    assert [i.url for i in cfg.decode] == ["http://c:1", "http://d:1"] and cfg.mode == "kvpush"
    with pytest.raises(SystemExit):  # kvpush needs P's side channel
        config_from_args(["--prefill=http://a:1", "--decode=http://c:1"])
    with pytest.raises(SystemExit):  # two P, one KV address
        config_from_args(["--prefill=http://a:1", "--prefill=http://b:1", "--prefill-kv=h:1", "--decode=http://c:1"])
    pull = config_from_args(["--mode=vllm-pull", "--prefill=http://a:1", "--decode=http://c:1"])
    assert pull.mode == "vllm-pull" and pull.prefill[0].kv_port is None


@pytest.mark.parametrize(
    ("mode", "ports", "ids"),
    [
        ("kvpush", [5600, 5602, 5604], [None] * 3),  # kvpush: one listener per TP rank, from port + k * tp
        ("vllm-push", [5600, 5601, 5602], ["eng_dp0", "eng_dp1", "eng_dp2"]),  # vLLM NIXL: port + k, <id>_dp<k>
    ],
)
def test_a_data_parallel_server_is_one_instance_per_dp_rank(mode: str, ports: list[int], ids: list) -> None:
    p = Instance("http://p:1/", "prefill", "10.0.0.1", 5600, 2, "eng" if mode == "vllm-push" else None)
    engines = dp_engines(p, 3, mode)
    assert [(e.url, e.kv_host, e.kv_port, e.tp_size, e.dp_rank) for e in engines] == [
        ("http://p:1", "10.0.0.1", port, 2, k) for k, port in enumerate(ports)
    ]
    assert [e.engine_id for e in engines] == ids
    assert len({id(e) for e in engines} | {id(p)}) == 4  # own load counters, the template untouched
    assert engines[1].name == "prefill http://p:1 (DP rank 1)" and p.dp_rank is None
    assert dp_engines(p, 1, mode) == [p]
    with pytest.raises(ValueError, match="data-parallel size must be >= 1, got 0"):
        dp_engines(p, 0, mode)
    with pytest.raises(ValueError, match="out of range"):
        dp_engines(Instance("http://p:1", "prefill", "h", 65534, 2), 2, "kvpush")


def test_cli_expands_data_parallel_servers() -> None:
    cfg = config_from_args(
        [
            "--prefill=http://a:1",
            "--prefill-kv=10.0.0.1:5600",
            "--prefill-tp=2",
            "--prefill-dp=2",
            "--decode=http://c:1",
            "--decode=http://d:1",
            "--decode-dp=3",
            "--decode-dp=1",
        ]
    )
    assert [(i.url, i.kv_port, i.dp_rank) for i in cfg.prefill] == [("http://a:1", 5600, 0), ("http://a:1", 5602, 1)]
    assert [(i.url, i.dp_rank) for i in cfg.decode] == [("http://c:1", k) for k in range(3)] + [("http://d:1", None)]
    with pytest.raises(SystemExit):  # two D, three DP sizes
        config_from_args(["--prefill=http://a:1", "--prefill-kv=h:1", "--decode=http://c:1", *["--decode-dp=2"] * 3])
    with pytest.raises(SystemExit):
        config_from_args(["--prefill=http://a:1", "--prefill-kv=h:1", "--prefill-dp=0", "--decode=http://c:1"])


# --------------------------------------------------------------------------- #
# Over HTTP.
# --------------------------------------------------------------------------- #


def test_router_picks_a_dp_rank_and_tells_d_its_side_channel() -> None:
    """P and D each serve two DP engines: every request pins one P engine with vLLM's ``X-data-parallel-rank``
    header and gives D that engine's side channel (kvpush: port + rank * tp); concurrent requests spread over
    the ranks of both (each rank's own in-flight count); no D request goes without a rank either."""

    async def go() -> None:
        async with cluster(p_dp=2, d_dp=2, p_tp=2) as c:
            c.p[0].delay = c.d[0].delay = 0.3
            got = await asyncio.gather(*(c.post("/v1/completions", COMPLETION) for _ in range(4)))
            assert [g[0] for g in got] == [200] * 4
            p_seen, d_seen = c.p[0].seen, c.d[0].seen
            tid_rank = {
                s.body["kv_transfer_params"]["transfer_id"]: int(s.headers["X-data-parallel-rank"]) for s in p_seen
            }
            assert sorted(tid_rank.values()) == [0, 0, 1, 1]
            for d in d_seen:
                params = d.body["kv_transfer_params"]
                assert params["remote_port"] == 5600 + 2 * tid_rank[params["transfer_id"]], params
                assert params["remote_tp_size"] == 2
            assert sorted(int(d.headers["X-data-parallel-rank"]) for d in d_seen) == [0, 0, 1, 1]

    run(go())


def test_without_data_parallelism_vllm_picks_the_engine() -> None:
    async def go() -> None:
        async with cluster() as c:
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert "X-data-parallel-rank" not in c.p[0].seen[0].headers
            assert "X-data-parallel-rank" not in c.d[0].seen[0].headers

    run(go())


def test_kvpush_sends_p_and_d_concurrently_with_one_transfer_id() -> None:
    async def go() -> None:
        async with cluster() as c:
            c.p[0].delay = c.d[0].delay = 0.4
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 200, data
            assert json.loads(data)["choices"][0]["text"] == "decoded"
            (p,), (d,) = c.p[0].seen, c.d[0].seen
            # Overlap: each arrived before the other finished.
            assert p.t_finish is not None and d.t_finish is not None
            assert d.t_arrive < p.t_finish and p.t_arrive < d.t_finish
            tid = p.body["kv_transfer_params"]["transfer_id"]
            assert tid and d.body["kv_transfer_params"]["transfer_id"] == tid
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"] == tid
            assert d.body["kv_transfer_params"] == {
                "do_remote_prefill": True,
                "transfer_id": tid,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "remote_tp_size": 1,
            }
            assert p.body["max_tokens"] == 1 and p.body["stream"] is False
            assert d.body["max_tokens"] == COMPLETION["max_tokens"] and d.body["prompt"] == COMPLETION["prompt"]
            # A second request gets a different transfer id.
            await c.post("/v1/completions", COMPLETION)
            assert c.p[0].seen[1].body["kv_transfer_params"]["transfer_id"] != tid

    run(go())


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_is_returned_byte_for_byte(path: str, body: dict[str, Any]) -> None:
    async def go() -> None:
        async with cluster() as c:
            async with c.session.post(c.url + path, json={**body, "stream": True}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                tid = r.headers["X-Request-Id"]
                got = b""
                async for chunk in r.content.iter_any():
                    got += chunk
            assert got == b"".join(STREAM_CHUNKS)
            (p,), (d,) = c.p[0].seen, c.d[0].seen
            assert d.path == p.path == path
            assert d.body["stream"] is True and p.body["stream"] is False
            assert p.body["kv_transfer_params"]["transfer_id"] == tid == d.body["kv_transfer_params"]["transfer_id"]
            if "messages" in body:
                assert p.body["max_completion_tokens"] == 1

    run(go())


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_non_streaming_returns_d_json(path: str, body: dict[str, Any]) -> None:
    async def go() -> None:
        async with cluster() as c:
            status, data, _ = await c.post(path, body)
            assert status == 200
            assert json.loads(data) == {"choices": [{"text": "decoded", "index": 0}], "served_by": c.d[0].url}

    run(go())


def test_least_loaded_decode_beats_round_robin() -> None:
    async def go() -> None:
        async with cluster(n_d=2) as c:
            c.d[0].delay = 2.5
            slow = asyncio.create_task(c.post("/v1/completions", COMPLETION))  # -> d0, stays busy
            while not c.d[0].seen:
                await asyncio.sleep(0.01)
            c.d[0].delay = 0.05
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200  # -> d1 (least loaded)
            # Round-robin would now pick d0 again; d0 still has the slow request.
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert len(c.d[0].seen) == 1 and len(c.d[1].seen) == 2
            assert (await slow)[0] == 200
            status, pending = await c.get_json("/kvpush/pending")
            assert status == 200 and pending["pending"] == 0 and pending["pending_prefill"] == 0

    run(go())


def test_prefill_goes_to_the_p_with_the_shortest_reported_queue() -> None:
    """P's own queue (its /metrics, filled by other routers too) counts, not only this router's requests."""

    async def go() -> None:
        async with cluster(n_p=2, queue_interval=0.05) as c:
            c.p[0].waiting = 7
            while c.router.prefill.instances[0].reported != 7:
                await asyncio.sleep(0.02)
            for _ in range(3):
                assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert len(c.p[0].seen) == 0 and len(c.p[1].seen) == 3
            _, pending = await c.get_json("/kvpush/pending")
            assert [i["reported"] for i in pending["prefill"]] == [7, 0]

    run(go())


def test_each_dp_rank_counts_its_own_engines_queue() -> None:
    """A data-parallel P's /metrics reports each engine's queue (``engine="<DP rank>"``): each DP rank's load
    is its own engine's, so requests avoid the busy engine of a server whose other engine is idle."""

    async def go() -> None:
        async with cluster(p_dp=2, queue_interval=0.05) as c:
            c.p[0].engine_waiting = {0: 7, 1: 0}
            ranks = c.router.prefill.instances
            while [i.reported for i in ranks] != [7, 0]:
                await asyncio.sleep(0.02)
            for _ in range(3):
                assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert [s.headers["X-data-parallel-rank"] for s in c.p[0].seen] == ["1"] * 3

    run(go())


def test_overload_is_a_fast_retryable_503_with_the_reason() -> None:
    """Beyond ``max_prefill_queue`` requests queued or running on the least-loaded P, the router answers 503
    at once (reason, Retry-After) and sends nothing to P or D; below it again, requests are served."""

    async def go() -> None:
        async with cluster(max_prefill_queue=2, queue_interval=0) as c:
            c.p[0].delay = 1.0
            busy = [asyncio.create_task(c.post("/v1/completions", COMPLETION)) for _ in range(2)]
            while len(c.p[0].seen) < 2:
                await asyncio.sleep(0.01)
            async with c.session.post(c.url + "/v1/completions", json=COMPLETION) as r:
                status, body, retry = r.status, await r.json(), r.headers.get("Retry-After")
            assert status == 503 and retry == "1", (status, body)
            err = body["error"]
            assert err["type"] == "overloaded" and err["retryable"] is True
            assert "2 requests queued or running (limit 2)" in err["message"], err
            assert len(c.p[0].seen) == 2 and len(c.d[0].seen) == 2  # the refused one reached neither
            assert [(await t)[0] for t in busy] == [200, 200]
            while c.router.prefill.instances[0].in_flight:  # D answers before P's one-token reply does
                await asyncio.sleep(0.02)
            c.p[0].delay = 0.05
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert c.router.counters["overloaded"] == 1

    run(go())


def test_decode_may_finish_before_prefill_answers() -> None:
    async def go() -> None:
        async with cluster() as c:
            c.p[0].delay, c.d[0].delay = 1.5, 0.05
            status, _, elapsed = await c.post("/v1/completions", COMPLETION)
            assert status == 200 and elapsed < 1.2  # D's answer is not held back by P's reply
            _, pending = await c.get_json("/kvpush/pending")
            assert pending["pending"] == 0 and pending["pending_prefill"] == 1
            assert pending["prefill"][0]["in_flight"] == 1  # P's load follows P's own request
            await asyncio.sleep(1.6)
            _, pending = await c.get_json("/kvpush/pending")
            assert pending["pending_prefill"] == 0 and pending["prefill"][0]["in_flight"] == 0
            assert not c.p[0].seen[0].disconnected  # P was allowed to finish

    run(go())


@pytest.mark.parametrize(("how", "cut_after"), [("cut", 1), ("cut", 2), ("short", 2)])
def test_decode_dying_mid_stream_ends_it_with_a_retryable_error_event(how: str, cut_after: int) -> None:
    """D dies after the client had bytes: no retry, no 502 glued on, but the stream's last event is the
    error (retryable), and a half-sent event of D's (cut after chunk 2) is not forwarded in pieces. A stream
    that ends cleanly without vLLM's last event (``data: [DONE]``) was cut short too."""

    async def go() -> None:
        async with cluster(n_d=2) as c:
            c.d[0].behavior, c.d[0].cut_after = how, cut_after
            got = b""
            async with c.session.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    got += chunk
            events = got.split(b"\n\n")
            assert events[-1] == b"" and events[0] + b"\n\n" == STREAM_CHUNKS[0] and len(events) == 3, got
            error = json.loads(events[1].removeprefix(b"data: "))["error"]
            assert error["retryable"] is True and error["role"] == "decode" and error["code"] == 502
            assert error["instance"] == c.router.decode.instances[0].url
            assert c.d[1].seen == []
            assert c.router.counters["decode_failures"] == 1 and c.router.counters["ok"] == 0

    run(go())


def test_dead_prefill_gives_fast_502_naming_it() -> None:
    async def go() -> None:
        async with cluster(n_p=0, dead_p=1) as c:
            c.d[0].delay = 5.0
            status, data, elapsed = await c.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 502 and elapsed < 2.0
            err = json.loads(data)["error"]
            assert err["role"] == "prefill" and err["instance"] == c.router.prefill.instances[0].url
            assert c.router.prefill.instances[0].url in err["message"]
            # D's request was abandoned, not left running for 5 s.
            await asyncio.sleep(0.2)
            assert all(s.disconnected for s in c.d[0].seen)

    run(go())


def test_failing_prefill_cancels_decode() -> None:
    async def go() -> None:
        async with cluster() as c:
            c.p[0].status = 500
            c.p[0].delay = 0.1
            c.d[0].delay = 5.0
            status, data, elapsed = await c.post("/v1/completions", COMPLETION)
            assert status == 502 and elapsed < 2.0
            assert "HTTP 500" in json.loads(data)["error"]["message"]
            await asyncio.sleep(0.2)
            (d,) = c.d[0].seen
            assert d.disconnected and d.t_finish is not None and d.t_finish - d.t_arrive < 1.0
            async with c.session.get(c.url + "/metrics") as r:
                text = await r.text()
            assert 'kvpush_router_requests_total{outcome="prefill_failures"} 1' in text
            assert "kvpush_router_pending_transfers 0" in text

    run(go())


def test_failed_decode_cancels_the_queued_prefill() -> None:
    """D gives up (an HTTP 5xx, no other D to retry on) while P's request still waits: the router closes P's
    connection, which makes vLLM drop the request from its queue before it spends the prefill."""

    async def go() -> None:
        async with cluster(retry_decode=False) as c:
            c.p[0].delay = 5.0  # queued behind a backlog
            c.d[0].status = 500
            status, _, elapsed = await c.post("/v1/completions", COMPLETION)
            assert status == 502 and elapsed < 2.0
            deadline = time.monotonic() + 5
            while c.p[0].seen[0].t_finish is None:
                assert time.monotonic() < deadline, "P's request was left running"
                await asyncio.sleep(0.02)
            assert c.p[0].seen[0].disconnected

    run(go())


def test_hanging_prefill_times_out() -> None:
    async def go() -> None:
        async with cluster(prefill_timeout=0.5) as c:
            c.p[0].behavior = "hang"
            c.d[0].behavior = "hang"
            status, data, elapsed = await c.post("/v1/completions", COMPLETION)
            assert status == 502 and 0.4 < elapsed < 2.0
            assert "no answer within 0.5 s" in json.loads(data)["error"]["message"]

    run(go())


def test_dead_decode_retries_on_another_decode() -> None:
    async def go() -> None:
        async with cluster(n_d=1, dead_d=1) as c:
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 200, data
            assert len(c.d[0].seen) == 1
            # P ran again for the retry, with a new transfer id matching the live D's.
            assert len(c.p[0].seen) == 2
            tids = [s.body["kv_transfer_params"]["transfer_id"] for s in c.p[0].seen]
            assert tids[0] != tids[1] == c.d[0].seen[0].body["kv_transfer_params"]["transfer_id"]
            assert not c.router.decode.instances[0].healthy  # passive health took it out
            assert c.router.counters["retries"] == 1

    run(go())


@pytest.mark.parametrize("fault", ["dead", "http_500", "dropped"])
def test_failed_prefill_retries_the_pairing_on_another_prefill(fault: str) -> None:
    """P refuses connections, answers 5xx, or dies with the request in hand, before D produced anything:
    D's request is abandoned and the pairing runs again on the other P, under a new transfer id."""

    async def go() -> None:
        async with cluster(n_p=1 if fault == "dead" else 2, dead_p=1 if fault == "dead" else 0) as c:
            if fault != "dead":
                c.p[0].status, c.p[0].behavior = (500, "ok") if fault == "http_500" else (200, "drop")
            c.d[0].delay = 0.5
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 200, data
            live = c.p[-1]
            assert len(live.seen) == 1 and c.router.counters["retries"] == 1
            tids = [s.body["kv_transfer_params"]["transfer_id"] for s in c.d[0].seen]
            assert tids[-1] == live.seen[0].body["kv_transfer_params"]["transfer_id"]
            # The first pairing's D request, when it got there before P failed, was abandoned.
            assert len(tids) >= 1 + (fault != "dead") and all(s.disconnected for s in c.d[0].seen[:-1])

    run(go())


def test_no_retry_turns_the_prefill_retry_off() -> None:
    async def go() -> None:
        async with cluster(n_p=2, retry_prefill=False) as c:
            c.p[0].status = 500
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            err = json.loads(data)["error"]
            assert status == 502 and err["role"] == "prefill" and err["retryable"] is True
            assert c.p[1].seen == []

    run(go())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_instance_that_dies_with_a_request_is_checked_at_once(role: str) -> None:
    """An instance that drops a request and whose /health then fails leaves rotation right away, without
    waiting for the periodic check (off here); one that dropped a request but answers /health stays."""

    async def go() -> None:
        async with cluster(n_p=2, n_d=2) as c:
            ups = c.p if role == "prefill" else c.d
            pool = c.router.prefill if role == "prefill" else c.router.decode
            ups[0].behavior, ups[0].health = "drop", 503
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            deadline = time.monotonic() + 5
            while pool.instances[0].healthy:
                assert time.monotonic() < deadline, "the failed instance was not checked"
                await asyncio.sleep(0.02)
            assert "503" in pool.instances[0].last_error and pool.instances[1].healthy
            ups[1].behavior, ups[1].health = "drop", 200  # a failure of one request, not of the instance
            ups[0].behavior, ups[0].health = "ok", 200
            await c.router.check_health()  # the periodic check re-admits the first
            assert pool.instances[0].healthy
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            await asyncio.sleep(0.3)
            assert pool.instances[1].healthy

    run(go())


def test_unavailable_is_a_retryable_503_with_retry_after() -> None:
    async def go() -> None:
        async with cluster(n_d=0, dead_d=1) as c:
            await c.router.check_health()
            async with c.session.post(c.url + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["retryable"] is True

    run(go())


def test_decode_500_retries_then_502_when_no_other_decode() -> None:
    async def go() -> None:
        async with cluster(n_d=2) as c:
            c.d[0].status = 500
            status, _, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 200 and len(c.d[1].seen) == 1
        async with cluster(n_d=1) as c:
            c.d[0].status = 503
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            err = json.loads(data)["error"]
            assert status == 502 and err["role"] == "decode" and "HTTP 503" in err["message"]

    run(go())


def test_client_error_passes_through_without_retry() -> None:
    async def go() -> None:
        async with cluster(n_d=2) as c:
            c.d[0].status = c.d[1].status = 400
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 400 and json.loads(data)["error"]["message"] == "decode says no"
            assert len(c.d[0].seen) + len(c.d[1].seen) == 1

    run(go())


def test_all_unhealthy_gives_503() -> None:
    async def go() -> None:
        async with cluster(n_d=0, dead_d=2) as c:
            await c.router.check_health()
            status, body = await c.get_json("/health")
            assert status == 503 and "no healthy decode instance" in body["error"]["message"]
            status, data, elapsed = await c.post("/v1/completions", COMPLETION)
            assert status == 503 and elapsed < 1.0
            assert "no healthy decode instance" in json.loads(data)["error"]["message"]
            assert c.p[0].seen == []  # nothing started on P

    run(go())


def test_health_check_marks_and_restores_instances() -> None:
    async def go() -> None:
        async with cluster(n_d=2) as c:
            c.d[0].health = 503
            await c.router.check_health()
            d0, d1 = c.router.decode.instances
            assert not d0.healthy and d1.healthy and "503" in d0.last_error
            for _ in range(3):
                assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert c.d[0].seen == [] and len(c.d[1].seen) == 3
            c.d[0].health = 200
            await c.router.check_health()
            assert d0.healthy
            status, body = await c.get_json("/health")
            assert status == 200 and body["status"] == "ok"

    run(go())


def test_health_timeouts_count_only_when_repeated() -> None:
    """A slow /health is a strike, not a verdict: a busy D stays in rotation
    until ``health_timeout_strikes`` checks in a row time out; an answered
    check resets the count, and a wrong answer still counts at once."""

    async def go() -> None:
        async with cluster(health_timeout=0.2, health_timeout_strikes=3) as c:
            (d,) = c.router.decode.instances
            c.d[0].health_delay = 1.0  # busy: answers, but after the timeout
            for strike in (1, 2):
                await c.router.check_health()
                assert d.healthy and d.health_timeouts == strike
            # Still serving while slow.
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            status, body = await c.get_json("/health")
            assert status == 200 and body["decode"][0]["health_timeouts"] == 2
            c.d[0].health_delay = 0.0
            await c.router.check_health()  # an answer resets the count
            assert d.healthy and d.health_timeouts == 0
            c.d[0].health_delay = 1.0
            for _ in range(2):
                await c.router.check_health()
            assert d.healthy
            await c.router.check_health()  # the third in a row
            assert not d.healthy and "no answer within 0.2 s (3 in a row)" in d.last_error
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 503 and "no answer within" in json.loads(data)["error"]["message"]
            await c.router.check_health()  # still slow: stays out
            assert not d.healthy
            c.d[0].health_delay = 0.0
            await c.router.check_health()
            assert d.healthy and d.health_timeouts == 0
            c.d[0].health = 503  # a wrong answer is definite: out at once
            await c.router.check_health()
            assert not d.healthy and "503" in d.last_error

    run(go())


def test_unreachable_instance_is_unhealthy_at_once_despite_strikes() -> None:
    """Connection refused is not a timeout: the process is gone or not
    listening, so the strikes rule does not delay it."""

    async def go() -> None:
        async with cluster(n_d=1, dead_d=1, health_timeout_strikes=5) as c:
            await c.router.check_health()
            dead, alive = c.router.decode.instances
            assert not dead.healthy and dead.health_timeouts == 0 and alive.healthy

    run(go())


def test_one_strike_restores_the_strict_rule() -> None:
    async def go() -> None:
        async with cluster(health_timeout=0.2, health_timeout_strikes=1) as c:
            c.d[0].health_delay = 1.0
            await c.router.check_health()
            assert not c.router.decode.instances[0].healthy

    run(go())


def test_idle_upstream_connections_are_let_go_before_the_upstream_closes_them() -> None:
    """vLLM's HTTP server closes a keep-alive connection idle for 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a
    request sent on it just as it closes is reset: a failure no fault explains (the soak met one, and an aiohttp
    client reusing connections at a server's limit lost about one request in three: docs/benchmarks-log.md,
    section 19). So the router keeps an idle connection to P or D for less (``upstream_keepalive``, 4 s by
    default; aiohttp's own is 15 s): one idle longer is never sent on again, one idle shorter still is."""

    async def go() -> tuple[list[int], list[int], list[int]]:
        async with cluster(upstream_keepalive=0.15, queue_interval=0) as c:
            c.p[0].delay = c.d[0].delay = 0.0
            statuses = [(await c.post("/v1/completions", COMPLETION))[0]]
            await asyncio.sleep(0.3)  # idle longer than the router keeps a connection
            statuses.append((await c.post("/v1/completions", COMPLETION))[0])
            statuses.append((await c.post("/v1/completions", COMPLETION))[0])  # at once: reused
            return statuses, [s.conn for s in c.p[0].seen], [s.conn for s in c.d[0].seen]

    statuses, p_conns, d_conns = run(go())
    assert statuses == [200] * 3
    for conns in (p_conns, d_conns):
        assert conns[1] != conns[0], "a connection idle past upstream_keepalive was sent on again"
        assert conns[2] == conns[1], "a connection idle for less was not reused"
    default = config_from_args(["--prefill", "http://p", "--prefill-kv", "h:1", "--decode", "http://d"])
    assert default.upstream_keepalive == 4.0
    with pytest.raises(ValueError):
        RouterConfig([Instance("http://p", "prefill", "h", 1)], [Instance("http://d", "decode")], upstream_keepalive=0)


def test_health_options_from_cli_and_validated() -> None:
    base = ["--prefill=http://a:1", "--prefill-kv=h:1", "--decode=http://c:1"]
    cfg = config_from_args(base)
    assert (cfg.health_timeout, cfg.health_timeout_strikes) == (5.0, 3)
    cfg = config_from_args([*base, "--health-timeout=7.5", "--health-timeout-strikes=1"])
    assert (cfg.health_timeout, cfg.health_timeout_strikes) == (7.5, 1)
    for bad in (["--health-timeout=0"], ["--health-timeout-strikes=0"]):
        with pytest.raises(SystemExit):
            config_from_args([*base, *bad])
    p, d = Instance("http://a:1", "prefill", "h", 1), Instance("http://c:1", "decode")
    with pytest.raises(ValueError, match="health_timeout_strikes"):
        RouterConfig(prefill=[p], decode=[d], health_timeout_strikes=0)


def test_models_and_metrics() -> None:
    async def go() -> None:
        async with cluster() as c:
            status, models = await c.get_json("/v1/models")
            assert status == 200 and models["data"][0]["id"] == "tiny"
            await c.post("/v1/completions", COMPLETION)
            async with c.session.get(c.url + "/metrics") as r:
                text = await r.text()
            assert "kvpush_router_pending_requests 0" in text
            assert 'kvpush_router_requests_total{outcome="ok"} 1' in text
            assert f'kvpush_router_instance_healthy{{role="decode",url="{c.d[0].url}"}} 1' in text

    run(go())


def test_invalid_json_is_400() -> None:
    async def go() -> None:
        async with cluster() as c:
            async with c.session.post(c.url + "/v1/completions", data=b"{nope") as r:
                assert r.status == 400
            assert c.p[0].seen == [] and c.d[0].seen == []

    run(go())


def test_vllm_pull_runs_p_first_and_hands_its_params_to_d() -> None:
    async def go() -> None:
        async with cluster(mode="vllm-pull") as c:
            c.p[0].delay = 0.2
            status, data, _ = await c.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and data == b"".join(STREAM_CHUNKS)
            (p,), (d,) = c.p[0].seen, c.d[0].seen
            assert p.t_finish is not None and d.t_arrive >= p.t_finish
            assert p.body["kv_transfer_params"]["do_remote_decode"] is True
            assert d.body["kv_transfer_params"]["remote_block_ids"] == [[1, 2, 3]]
            assert d.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"

    run(go())


def test_vllm_push_learns_engine_id_then_goes_concurrent() -> None:
    async def go() -> None:
        async with cluster(mode="vllm-push", engine_ids=False) as c:
            c.p[0].delay = c.d[0].delay = 0.5
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            p1, d1 = c.p[0].seen[0], c.d[0].seen[0]
            assert p1.t_finish is not None and d1.t_arrive >= p1.t_finish  # sequential: id unknown
            assert d1.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"
            assert p1.headers["X-Request-Id"] == d1.headers["X-Request-Id"]
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            p2, d2 = c.p[0].seen[1], c.d[0].seen[1]
            assert p2.t_finish is not None and d2.t_arrive < p2.t_finish  # concurrent now
            assert d2.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"
            assert p2.headers["X-Request-Id"] == d2.headers["X-Request-Id"]
            assert d2.body["kv_transfer_params"]["remote_port"] == 5600

    run(go())


def test_client_kv_transfer_params_never_reach_p_or_d_by_default() -> None:
    """A client must not choose transfer ids, hosts or ports: rejected (400 naming the field) or stripped."""
    forged = {"do_remote_prefill": True, "transfer_id": "victim", "remote_host": "10.6.6.6", "remote_port": 1}

    async def go() -> None:
        async with cluster() as c:
            status, data, _ = await c.post("/v1/completions", {**COMPLETION, "kv_transfer_params": forged})
            assert status == 400 and b"kv_transfer_params" in data
            assert not c.p[0].seen and not c.d[0].seen
        async with cluster(client_params="strip") as c:
            status, _, _ = await c.post("/v1/completions", {**COMPLETION, "kv_transfer_params": forged})
            assert status == 200
            (p,), (d,) = c.p[0].seen, c.d[0].seen
            for seen in (p, d):
                params = seen.body["kv_transfer_params"]
                assert params["transfer_id"] != "victim" and "10.6.6.6" not in json.dumps(seen.body)
            assert d.body["kv_transfer_params"]["remote_port"] == 5600
        async with cluster(client_params="trust") as c:  # behind another router that chooses transfer ids
            status, _, _ = await c.post("/v1/completions", {**COMPLETION, "kv_transfer_params": {"transfer_id": "t7"}})
            assert status == 200
            assert c.p[0].seen[0].body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "t7"}
            d_params = c.d[0].seen[0].body["kv_transfer_params"]
            assert d_params["transfer_id"] == "t7" and d_params["do_remote_prefill"] is True  # merged, not replaced
            assert (d_params["remote_host"], d_params["remote_port"]) == ("127.0.0.1", 5600)

    run(go())
    with pytest.raises(SystemExit):
        config_from_args(["--prefill=http://a:1", "--prefill-kv=h:1", "--decode=http://b:1", "--client-kv-params=x"])
    assert (
        config_from_args(
            ["--prefill=http://a:1", "--prefill-kv=h:1", "--decode=http://b:1", "--client-kv-params=strip"]
        ).client_params
        == "strip"
    )


def test_vllm_push_mode_speaks_only_vllms_conventions() -> None:
    """What vLLM's push proxy sends: no transfer id anywhere; P and D paired by one X-Request-Id."""

    async def go() -> None:
        async with cluster(mode="vllm-push") as c:
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            (p,), (d,) = c.p[0].seen, c.d[0].seen
            assert "transfer_id" not in p.body["kv_transfer_params"]
            assert "transfer_id" not in d.body["kv_transfer_params"]
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"]
            assert d.body["kv_transfer_params"]["remote_request_id"] == d.headers["X-Request-Id"]

    run(go())


# --------------------------------------------------------------------------- #
# The process launcher (kvpush_tools.demo.servers) and the router's CLI, for real.
# --------------------------------------------------------------------------- #


def test_launcher_reports_a_dying_server_with_its_log(tmp_path: Any) -> None:
    from kvpush_tools.demo.launcher import ServerError, ServerProcess

    cmd = [sys.executable, "-c", "import sys; print('model not found: /nope', flush=True); sys.exit(3)"]
    s = ServerProcess("victim", cmd, closed_port_url(), tmp_path / "victim.log").start()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)victim exited with code 3.*model not found: /nope"):
        s.wait_healthy(timeout=30)
    assert time.monotonic() - t0 < 10
    s.stop()


def test_launcher_reports_the_first_error_not_only_the_shutdown_after_it(tmp_path: Any) -> None:
    """Data parallel: one engine core fails, the others print their shutdown; the cause must be in the error."""
    from kvpush_tools.demo.launcher import ServerError, ServerProcess

    script = (
        "import sys\n"
        "print('starting', flush=True)\n"
        "print('Traceback (most recent call last):\\nOSError: [Errno 98] Address already in use', flush=True)\n"
        "for i in range(80): print('shutdown noise', i, flush=True)\n"
        "sys.exit(1)\n"
    )
    s = ServerProcess("dp", [sys.executable, "-c", script], closed_port_url(), tmp_path / "dp.log").start()
    with pytest.raises(ServerError, match=r"(?s)first error.*Address already in use.*last lines") as err:
        s.wait_healthy(timeout=30)
    assert "shutdown noise 79" in str(err.value)
    s.stop()


def test_free_ports_lie_outside_the_ephemeral_range() -> None:
    """Ports picked for servers that bind late never collide with the local end of outgoing connections."""
    from kvpush_tools.demo.launcher import ephemeral_ports, free_port, port_is_free

    for _ in range(20):
        base = free_port(span=4)
        assert all(base + i not in ephemeral_ports() and port_is_free(base + i) for i in range(4))
        assert base >= 20000  # above Ray's worker ports


STUBBORN = """
import signal, subprocess, sys, time
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
if sys.argv[1:] != ["child"]:
    c = subprocess.Popen([sys.executable, __file__, "child"])
    print("child", c.pid, flush=True)
time.sleep(600)
"""


def test_launcher_stop_kills_the_whole_process_group(tmp_path: Any) -> None:
    from kvpush_tools.demo.launcher import ServerError, ServerProcess

    # A server that ignores SIGINT, with a child that would outlive it.
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    cmd = [sys.executable, str(tmp_path / "stubborn.py")]
    s = ServerProcess("stubborn", cmd, closed_port_url(), tmp_path / "s.log").start()
    with pytest.raises(ServerError, match="not healthy after 1 s"):
        s.wait_healthy(timeout=1)
    child = _logged_child(s.log_path)
    t0 = time.monotonic()
    s.stop(grace=0.5)
    assert time.monotonic() - t0 < 5 and not s.alive
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), f"child {child} of the stopped server still runs"


def test_launcher_dying_takes_its_servers_along(tmp_path: Any) -> None:
    """A launcher killed outright (CI timeout) must leave no server behind,
    even one that ignores SIGINT and SIGTERM, nor that server's children."""
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    (tmp_path / "launcher.py").write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvpush_tools.demo.launcher import ServerProcess\n"
        "d = Path(sys.argv[1])\n"
        "cmd = [sys.executable, str(d / 'stubborn.py')]\n"
        "s = ServerProcess('x', cmd, 'http://127.0.0.1:1', d / 'x.log', guard_grace=1.0).start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    lp = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert lp.stdout is not None
        guard = int(lp.stdout.readline())
        grandchild = _logged_child(tmp_path / "x.log")
        lp.kill()
        lp.wait()
        deadline = time.monotonic() + 8
        while not (_gone(guard) and _gone(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(guard) and _gone(grandchild)
    finally:
        lp.kill()


def _logged_child(log: Path) -> int:
    """The pid STUBBORN printed into its server log."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "child " in text:
            return int(text.split("child ", 1)[1].split()[0])
        time.sleep(0.05)
    raise AssertionError(f"no child pid in {log}")


def _gone(pid: int) -> bool:
    """Dead or a zombie (an orphan whose reaper is slow is still dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_router_cli_subprocess_serves_and_stops(tmp_path: Any) -> None:
    from kvpush_tools.demo.launcher import free_port, port_is_free
    from kvpush_tools.demo.servers import router_server

    async def go() -> None:
        async with cluster() as c:
            port = free_port()
            args = ["--prefill", c.p[0].url, "--prefill-kv", "127.0.0.1:5600", "--decode", c.d[0].url]
            r = router_server(args, port, log_dir=tmp_path).start()
            try:
                await asyncio.to_thread(r.wait_healthy, 30)
                async with c.session.post(r.url + "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
                    assert resp.status == 200 and await resp.read() == b"".join(STREAM_CHUNKS)
                assert c.d[0].seen[0].body["kv_transfer_params"]["remote_port"] == 5600
            finally:
                assert r.stop(grace=5) is not None
            # the listener goes with the process; on a loaded host its socket may close a moment after the exit
            deadline = time.monotonic() + 10
            while not port_is_free(port) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert port_is_free(port)

    run(go())


def test_tiny_model_prompts_have_exactly_n_tokens() -> None:
    """The e2e test relies on prompt lengths in tokens; checked on the tiny
    model's tokenizer itself (built without transformers, so it is quick)."""
    from kvpush_tools.demo.words import MIN_VOCAB_SIZE, UNK, prompt_words, vocabulary, word_tokenizer

    words = vocabulary(2048)
    assert len(set(words)) == 2048 and vocabulary(MIN_VOCAB_SIZE) == words[:MIN_VOCAB_SIZE]
    tok = word_tokenizer({w: i for i, w in enumerate(words)}, lambda tokenizer_object, **_: tokenizer_object)
    for n in (1, 31, 32, 33, 1000, 3000):
        ids = tok.encode(prompt_words(n, seed=n)).ids
        assert len(ids) == n and words.index(UNK) not in ids
    assert prompt_words(50, seed=1) == prompt_words(50, seed=1) != prompt_words(50, seed=2)
    assert prompt_words(10, seed=3).split()[:5] != prompt_words(10, seed=4).split()[:5]


def test_with_a_capability_key_d_gets_the_transfers_capability_in_every_mode() -> None:
    from kvpush.core.capability import derive_key, mint

    key = derive_key(b"k" * 40)
    p = Instance("http://p", "prefill", "10.1.1.1", 5600, 2, "eng-7")
    cap = mint(key, "t9")
    assert decode_params("kvpush", "t9", p, capability=cap)["capability"] == cap
    push = decode_params("vllm-push", "t9", p, capability=cap)
    assert (push["capability"], push["transfer_id"]) == (cap, "t9")
    assert prefill_body(COMPLETION, "vllm-push", "t9", bound=True)["kv_transfer_params"]["transfer_id"] == "t9"
    assert "transfer_id" not in prefill_body(COMPLETION, "vllm-push", "t9")["kv_transfer_params"]
    # P first (engine id unknown): P's own capability is passed on; in vllm-pull P's answer goes as it is
    unknown = Instance("http://p", "prefill", "10.1.1.1", 5600)
    answer = {"kv_transfer_params": {"remote_engine_id": "e", "capability": "c" * 32}}
    assert decode_params("vllm-push", "t9", unknown, answer)["capability"] == "c" * 32
    assert decode_params("vllm-pull", "t9", p, answer) == answer["kv_transfer_params"]

    async def go() -> None:
        async with cluster(capability_key=key) as c:
            status, data, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 200, data
            (p_seen,), (d_seen,) = c.p[0].seen, c.d[0].seen
            tid = p_seen.body["kv_transfer_params"]["transfer_id"]
            assert d_seen.body["kv_transfer_params"]["capability"] == mint(key, tid)
            assert "capability" not in p_seen.body["kv_transfer_params"], "P derives it itself"

    run(go())


def test_the_router_reads_its_capability_key_from_kvpush_keys(tmp_path: Path) -> None:
    from kvpush.cli.keys import main as keys_main
    from kvpush.core.capability import derive_key
    from kvpush.core.errors import ConfigError
    from kvpush.transport import key_set

    assert keys_main([str(tmp_path)]) == 0
    router_file = tmp_path / key_set.ROUTER_KEY
    assert router_file.stat().st_mode & 0o777 == 0o600
    _, secret = key_set.read_key_file(tmp_path / key_set.PREFILL_SECRET, need_secret=True)
    assert secret is not None and key_set.router_capability_key(router_file) == derive_key(secret)
    assert key_set.router_capability_key(tmp_path) == derive_key(secret)  # a key set directory
    assert router_file.read_text().strip() != secret.decode(), "the router's file is not P's key"
    args = ["--prefill", "http://p", "--prefill-kv", "127.0.0.1:5600", "--decode", "http://d"]
    assert config_from_args([*args, "--capability-key", str(router_file)]).capability_key == derive_key(secret)
    bad = tmp_path / "bad.key"
    bad.write_text("not hex\n")
    with pytest.raises(ConfigError, match="capability key file"):
        key_set.router_capability_key(bad)
    assert key_set.router_capability_key(tmp_path / "decoders") is None
