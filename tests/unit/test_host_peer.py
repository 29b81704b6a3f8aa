"""Host backend peer copies: P writes a real D process's KV blocks with process_vm_writev, byte for byte.

A spawned child is D: it holds host-backend test caches filled from a seed and
exports them (``HostBackend.export_peer``). This process is P: it opens the
blob and copies a shuffled piece list (more iovecs than one call takes, odd
lengths, partial blocks) into the child's regions. The child's regions, read
back in the child, must hold P's bytes in exactly the pieces and their old
bytes everywhere else. The refusals are checked the same way, against a live
(or dead) process: a blob of another boot, a region D did not export, a piece
outside the spans (nothing written), a pid that is gone or is not the
exporter, a malformed blob.
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvpush.backends import host_peer
from kvpush.backends.base import CacheSpec
from kvpush.backends.host import HostBackend
from kvpush.backends.peer import PeerCopy
from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout, Region

pytestmark = pytest.mark.skipif(not host_peer.available(), reason="no process_vm_writev on this platform")

SPEC = CacheSpec(block_size=4, num_heads=2, head_dim=8, dtype="float16", axes="KBNHC")
LAYERS = 4
BLOCKS = 64
D_SEED = 11
P_SEED = 22


def _cache(seed: int) -> tuple[HostBackend, dict[str, Any], KVLayout]:
    b = HostBackend()
    kv = b.make_test_cache(SPEC, LAYERS, BLOCKS)
    rng = np.random.default_rng(seed)
    for t in kv.values():
        b.write_bytes(t, rng.integers(0, 256, t.nbytes, dtype=np.uint8))
    return b, kv, b.describe(kv, SPEC)


def _regions(layout: KVLayout) -> list[bytes]:
    return [ctypes.string_at(r.base, r.size) for r in layout.regions]


def _d_main(conn: Any) -> None:
    """D: serve ``export`` (blob, layout) and ``regions`` (each region's bytes) until ``exit``."""
    b, _kv, layout = _cache(D_SEED)  # _kv keeps the exported memory alive
    while True:
        op = conn.recv()
        if op == "export":
            conn.send((b.export_peer(layout), msgspec.msgpack.encode(layout)))
        elif op == "regions":
            conn.send(_regions(layout))
        else:
            conn.send(None)
            return


class D:
    """A D process and its end of the pipe."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_d_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        blob, layout = self.call("export")
        self.blob: bytes = blob
        self.layout = msgspec.msgpack.decode(layout, type=KVLayout)

    def call(self, op: str) -> Any:
        self.conn.send(op)
        if not self.conn.poll(60):
            raise AssertionError(f"D did not answer {op!r}")
        return self.conn.recv()

    def regions(self) -> list[np.ndarray]:
        return [np.frombuffer(r, dtype=np.uint8).copy() for r in self.call("regions")]

    def stop(self) -> None:
        self.call("exit")
        self.proc.join(30)
        assert self.proc.exitcode == 0


@pytest.fixture(scope="module")
def d() -> Iterator[D]:
    proc = D()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def p() -> tuple[HostBackend, dict[str, Any], KVLayout]:
    return _cache(P_SEED)


def _pieces(rng: np.random.Generator, layout: KVLayout, count: int) -> np.ndarray:
    """``count`` pieces with distinct destination blocks: whole blocks and random sub-ranges, shuffled."""
    block = layout.block_size * layout.local_heads * layout.head_bytes
    src = rng.integers(0, BLOCKS, count)
    dst = rng.permutation(BLOCKS)[:count] if count <= BLOCKS else None
    assert dst is not None
    out = []
    for s, t in zip(src.tolist(), dst.tolist(), strict=True):
        a, b = (0, block) if rng.random() < 0.5 else sorted(rng.choice(block + 1, 2, replace=False).tolist())
        out.append((s * layout.block_stride + a, t * layout.block_stride + a, b - a))
    return np.array(out, dtype=np.int64)[rng.permutation(count)]


def _sub_pieces(rng: np.random.Generator, layout: KVLayout) -> np.ndarray:
    """Every destination block split into up to 8 pieces of odd lengths: many more iovecs than one call takes."""
    block = layout.block_size * layout.local_heads * layout.head_bytes
    out = []
    for t in range(BLOCKS):
        cuts = sorted({0, block, *rng.integers(1, block, rng.integers(3, 8)).tolist()})
        s = int(rng.integers(0, BLOCKS))
        for a, b in itertools.pairwise(cuts):
            out.append((s * layout.block_stride + a, t * layout.block_stride + a, b - a))
    return np.array(out, dtype=np.int64)[rng.permutation(len(out))]


def _expect(before: list[np.ndarray], src: list[np.ndarray], pieces: np.ndarray) -> list[np.ndarray]:
    out = [r.copy() for r in before]
    for r, s in zip(out, src, strict=True):
        for so, do, n in pieces.tolist():
            r[do : do + n] = s[so : so + n]
    return out


def _reencode(blob: bytes, **change: Any) -> bytes:
    exp = msgspec.msgpack.decode(blob, type=host_peer.PeerExport)
    return msgspec.msgpack.encode(msgspec.structs.replace(exp, **change))


def test_host_backend_implements_peer_copy() -> None:
    assert isinstance(HostBackend(), PeerCopy)


@pytest.mark.parametrize("kind", ["blocks", "sub_blocks"])
def test_copy_into_a_live_process_is_byte_exact(d: D, p: Any, kind: str) -> None:
    backend, _, p_layout = p
    rng = np.random.default_rng(5 if kind == "blocks" else 6)
    pieces = _pieces(rng, d.layout, 40) if kind == "blocks" else _sub_pieces(rng, d.layout)
    regions = len(d.layout.regions)
    if kind == "sub_blocks":
        assert len(pieces) * regions > 2 * host_peer.IOV_MAX  # three calls at least
    before = d.regions()
    src = [np.frombuffer(r, dtype=np.uint8).copy() for r in _regions(p_layout)]
    handle = backend.open_peer(d.blob, d.layout)
    assert handle is not None
    marker = backend.start_peer_copy(
        handle, [r.base for r in p_layout.regions], [r.base for r in d.layout.regions], pieces
    )
    backend.wait_ready(marker)
    assert backend.poll_ready(marker)
    backend.close_peer(handle)
    after = d.regions()
    want = _expect(before, src, pieces)
    for i, (a, w, b) in enumerate(zip(after, want, before, strict=True)):
        assert not np.array_equal(w, b), f"region {i}: the pieces change nothing, the check would be vacuous"
        np.testing.assert_array_equal(a, w, err_msg=f"region {i}")
    for i, (now, was) in enumerate(zip(_regions(p_layout), src, strict=True)):
        np.testing.assert_array_equal(np.frombuffer(now, dtype=np.uint8), was, err_msg=f"P's region {i} changed")


def test_piece_outside_the_exported_spans_is_refused_before_any_byte_moves(d: D, p: Any) -> None:
    backend, _, p_layout = p
    handle = backend.open_peer(d.blob, d.layout)
    assert handle is not None
    last = max(range(len(d.layout.regions)), key=lambda i: d.layout.regions[i].base)
    end = int(handle.hi[-1]) - d.layout.regions[last].base  # offset of the last exported byte's end
    ok = (0, 0, 16)
    straddle = (0, end - 1, 2)  # one byte in, one byte past the end
    pieces = np.array([ok, straddle], dtype=np.int64)
    before = d.regions()
    with pytest.raises(BackendError, match=rf"outside what D \(pid {d.proc.pid}\) exported"):
        backend.start_peer_copy(handle, [r.base for r in p_layout.regions], [r.base for r in d.layout.regions], pieces)
    for a, b in zip(d.regions(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    # The same pieces one byte shorter fit: the refusal was about the byte past the end.
    backend.start_peer_copy(
        handle,
        [r.base for r in p_layout.regions],
        [r.base for r in d.layout.regions],
        np.array([ok, (0, end - 1, 1)], dtype=np.int64),
    )


def test_another_boot_is_out_of_reach(d: D) -> None:
    assert HostBackend().open_peer(_reencode(d.blob, boot_id="00000000-0000-0000-0000-000000000000"), d.layout) is None


def test_region_outside_the_exported_spans_is_out_of_reach(d: D) -> None:
    exp = msgspec.msgpack.decode(d.blob, type=host_peer.PeerExport)
    lo, hi = host_peer.merge_spans(list(exp.spans))
    assert HostBackend().open_peer(d.blob, d.layout) is not None
    # The exported spans one byte short at the end: the last region no longer fits.
    shrunk = [(int(a), int(b - a)) for a, b in zip(lo, hi, strict=True)]
    shrunk[-1] = (shrunk[-1][0], shrunk[-1][1] - 1)
    assert HostBackend().open_peer(_reencode(d.blob, spans=tuple(shrunk)), d.layout) is None
    # Nothing exported at all.
    assert HostBackend().open_peer(_reencode(d.blob, spans=()), d.layout) is None
    # A layout naming a region one byte past the exported spans, with the blob intact.
    r = d.layout.regions[0]
    moved = msgspec.structs.replace(d.layout, regions=(Region(int(hi[-1]) - r.size + 1, r.size), *d.layout.regions[1:]))
    assert HostBackend().open_peer(d.blob, moved) is None


def test_another_process_behind_the_pid_is_out_of_reach(d: D) -> None:
    """The cookie read back differs: the pid is not the exporter (another namespace, a reused pid)."""
    assert HostBackend().open_peer(_reencode(d.blob, cookie=bytes(host_peer.COOKIE_BYTES)), d.layout) is None


def test_dead_pid_is_out_of_reach() -> None:
    gone = D()
    gone.stop()
    assert HostBackend().open_peer(gone.blob, gone.layout) is None


def test_malformed_blob_is_an_error_naming_it(d: D) -> None:
    backend = HostBackend()
    with pytest.raises(BackendError, match="not a peer-copy blob"):
        backend.open_peer(b"\x01garbage", d.layout)
    raw = msgspec.msgpack.decode(d.blob)
    del raw["pid"]
    with pytest.raises(BackendError, match=r"malformed process_vm v1 blob.*pid"):
        backend.open_peer(msgspec.msgpack.encode(raw), d.layout)
    raw = msgspec.msgpack.decode(d.blob)
    raw["cookie"] = b"short"
    with pytest.raises(BackendError, match=r"malformed.*cookie"):
        backend.open_peer(msgspec.msgpack.encode(raw), d.layout)


def test_another_mechanism_or_version_is_out_of_reach(d: D) -> None:
    raw = msgspec.msgpack.decode(d.blob)
    assert HostBackend().open_peer(msgspec.msgpack.encode({**raw, "mechanism": "cuda_ipc"}), d.layout) is None
    newer = {**raw, "version": host_peer.VERSION + 1, "field_of_v2": 1}
    assert HostBackend().open_peer(msgspec.msgpack.encode(newer), d.layout) is None


def test_a_write_the_kernel_cuts_short_is_an_error_naming_pid_and_bytes(d: D, p: Any) -> None:
    """D exported a span with nothing mapped behind it: the kernel writes the first piece and stops there,
    and a partial count is a failed copy, not a success."""
    backend, _, p_layout = p
    hole = 0x10000  # the lowest address a process may map (vm.mmap_min_addr); nothing is mapped there
    exp = msgspec.msgpack.decode(d.blob, type=host_peer.PeerExport)
    handle = backend.open_peer(_reencode(d.blob, spans=(*exp.spans, (hole, 4096))), d.layout)
    assert handle is not None
    pieces = np.array([(0, 0, 16)], dtype=np.int64)
    with pytest.raises(BackendError, match=rf"into pid {d.proc.pid} wrote 16 of 32 bytes"):
        backend.start_peer_copy(
            handle, [r.base for r in p_layout.regions[:2]], [d.layout.regions[0].base, hole], pieces
        )
