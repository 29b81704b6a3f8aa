"""D's thread around the Register's send, through real NIXL agents and the real side channel (one process).

The Register is put on the wire by ZMQ's I/O thread, not by D's engine thread;
what D's thread does right after the send (its unpack list) is off the path.
So D's thread yields its core between the two (``receiver._yield_core``): on a
host with no idle core, that work would otherwise keep the I/O thread, and
the Register, waiting.
"""

from __future__ import annotations

import os

import pytest
from helpers_local_pair import local_pair

from kvpush.core import protocol
from kvpush.engine.conns import Conns
from kvpush.engine.unpacks import UnpackRunner


def test_d_yields_its_core_after_sending_the_register_before_building_its_unpack_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    send, prepare = Conns.send, UnpackRunner.prepare

    def sending(self: Conns, key: object, msg: object) -> bool:
        ok = send(self, key, msg)  # type: ignore[arg-type]
        if isinstance(msg, protocol.Register):
            events.append("sent")
        return ok

    def preparing(self: UnpackRunner, *args: object) -> None:
        events.append("unpack list")
        prepare(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Conns, "send", sending)
    monkeypatch.setattr(UnpackRunner, "prepare", preparing)
    monkeypatch.setattr(os, "sched_yield", lambda: events.append("yield"))
    with local_pair(plan="staged", staging_bytes=1 << 20) as pair:
        pair.push("t0", 40, [5, 1, 9], [2, 7, 3])
        [d] = pair.wait(pair.receiver, 1)
        [p] = pair.wait(pair.sender, 1)
    assert d.ok and p.ok, (d.reason, p.reason)
    assert events == ["sent", "yield", "unpack list"], events
