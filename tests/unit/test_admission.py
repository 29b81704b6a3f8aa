"""The per-D-key budget of P (``kvpush.prefill.admission``), without NIXL: names per key, bytes per key, the block
ceiling from P's own cache, and NIXL metadata held to what NIXL makes for the declared regions."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.prefill import admission
from kvpush.prefill.admission import (
    BLOCK_ID_BYTES,
    NAME_BYTES,
    REGISTRATION_BYTES,
    Admission,
    KeyLimits,
    block_ceiling,
    holding_cost,
    metadata_problem,
    name_cost,
    names_cap,
)

KEY, OTHER = "K" * 40, "O" * 40


def _entry(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def serdes(name: bytes = b"agent", conns: int = 1, sections: tuple[int, ...] = (2,), desc: int = 35) -> bytes:
    """NIXL metadata in ``nixlSerDes`` form, as NIXL 1.3-1.5 write it (checked against real agents in
    ``test_budget_nixl``): agent name, backends' connection info, per section its buffers' entries."""
    out = admission.SERDES + _entry(b"Agent", name) + _entry(b"Conns", struct.pack("<Q", conns))
    for _ in range(conns):
        out += _entry(b"t", b"UCX") + _entry(b"c", b"\x01" * 213)
    out += _entry(b"", b"MemSection") + _entry(b"nixlSecElms", struct.pack("<Q", len(sections)))
    for n in sections:
        out += _entry(b"bknd", b"UCX") + _entry(b"nixlDList", b"nixlSDList") + _entry(b"t", b"\0" * 4)
        out += _entry(b"n", struct.pack("<Q", n))
        for _ in range(n):
            out += _entry(b"", b"\x02" * desc)
    return out


def test_metadata_as_nixl_makes_it_passes() -> None:
    for regions in range(4):
        assert metadata_problem(serdes(sections=(regions,)), regions) == ""
        assert metadata_problem(serdes(sections=(regions,)), regions + 3) == ""
    assert metadata_problem(serdes(conns=2, sections=(2, 1)), 2) == ""


def test_metadata_with_a_tail_is_refused_naming_it() -> None:
    blob = serdes()
    for tail in (b"x", b"\0" * 100, b"\0" * (6 << 20)):
        why = metadata_problem(blob + tail, 2)
        assert f"{len(tail)} bytes after its end (a blob of {len(blob)} bytes)" in why, why


def test_metadata_with_more_buffers_than_declared_is_refused() -> None:
    assert "'n' is 3 (at most 2)" in metadata_problem(serdes(sections=(3,)), 2)


def test_metadata_padded_inside_is_refused() -> None:
    """The tail hidden in an entry: a name, a connection info or a buffer entry larger than any NIXL makes."""
    assert "'Agent' holds" in metadata_problem(serdes(name=b"a" * 5000), 2)
    assert "holds 9000 bytes" in metadata_problem(serdes(desc=9000), 2)
    big = serdes().replace(_entry(b"c", b"\x01" * 213), _entry(b"c", b"\x01" * (1 << 20)))
    assert "'c' holds" in metadata_problem(big, 2)
    assert "'Conns' is 17" in metadata_problem(serdes(conns=17), 2)


def test_metadata_cut_short_or_garbled_is_refused() -> None:
    blob = serdes()
    for cut in range(len(admission.SERDES) + 1, len(blob)):
        assert metadata_problem(blob[:cut], 2), cut
    assert "malformed" in metadata_problem(blob.replace(b"MemSection", b"MemSectioX"), 2)


@given(st.binary(max_size=600))
@settings(max_examples=300, deadline=None)
def test_metadata_parse_never_raises(junk: bytes) -> None:
    metadata_problem(admission.SERDES + junk, 4)
    metadata_problem(serdes()[:40] + junk, 4)


def test_metadata_of_another_form_is_bounded_by_size() -> None:
    assert metadata_problem(b"\0" * 1000, 2) == ""
    most = admission.OPAQUE_BASE_BYTES + 2 * admission.OPAQUE_PER_REGION_BYTES
    assert metadata_problem(b"\0" * most, 2) == ""
    assert f"at most {most}" in metadata_problem(b"\0" * (most + 1), 2)


def test_block_ceiling_is_what_ps_cache_can_prefill_in_ds_blocks() -> None:
    assert block_ceiling(64, 16, 16) == 65
    assert block_ceiling(64, 16, 32) == 33
    assert block_ceiling(64, 16, 5) == -(-1024 // 5) + 1
    # never below what a prompt filling P's cache needs
    for p_blocks, p_bs, d_bs in [(1, 1, 1), (7, 3, 2), (1000, 16, 64)]:
        assert block_ceiling(p_blocks, p_bs, d_bs) * d_bs >= p_blocks * p_bs


def test_names_per_key_capped_by_the_key_sets_declared_ranks_else_the_default() -> None:
    lim = KeyLimits(1 << 40, 4)
    assert names_cap(lim, None) == 4 and names_cap(lim, 3) == 6
    a = Admission(lim)
    for i in range(6):
        assert a.hello(KEY, ("e", i), 100, 3, []) == ""
        a.add(KEY, ("e", i), 100)
    why = a.hello(KEY, ("e", 6), 100, 3, [])
    assert KEY[:8] in why and "known as 6 D ranks" in why and "3 ranks declared in its key set" in why, why
    assert "peer_max_ranks" in a.hello(KEY, ("e", 6), 100, None, [])
    assert a.hello(KEY, ("e", 0), 100, 3, []) == ""  # a name it holds (it said hello again)
    assert a.hello(OTHER, ("e", 9), 100, 3, []) == ""  # another key has its own
    a.remove(KEY, ("e", 0))
    assert a.hello(KEY, ("e", 6), 100, 3, []) == ""


def test_bytes_per_key_count_names_metadata_registrations_and_block_ids() -> None:
    lim = KeyLimits(2 * name_cost(1000) + holding_cost(3, 500), 100)
    a = Admission(lim)
    a.add(KEY, "n0", 1000)
    assert a.hello(KEY, "n1", 1000, None, [(3, 500)]) == ""
    a.add(KEY, "n1", 1000)
    assert a.held(KEY, [(1, 200), (2, 300)]) == lim.max_bytes
    why = a.register(KEY, [(1, 200), (2, 300)], 1)
    assert "D key KKKKKKKK" in why and f"peer_key_bytes {lim.max_bytes}" in why, why
    assert a.register(KEY, [(1, 200), (2, 299)], 1, replacing=0) == ""  # replaces one: no new registration
    assert a.register(OTHER, [], 10) == ""  # the other key's budget is its own
    assert "one more D rank" in a.hello(KEY, "n2", 0, None, [(3, 500)])
    assert a.names_bytes(KEY) == 2 * (NAME_BYTES + admission.METADATA_FACTOR * 1000)


def test_costs_are_what_the_docs_state() -> None:
    assert holding_cost(2, 10) == 2 * REGISTRATION_BYTES + 10 * BLOCK_ID_BYTES


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["hello", "bye", "reg"]),
            st.sampled_from([KEY, OTHER]),
            st.integers(0, 9),
            st.integers(0, 1 << 16),
        ),
        max_size=60,
    ),
    st.sampled_from([None, 1, 2, 5]),
)
@settings(max_examples=300, deadline=None)
def test_what_is_admitted_never_exceeds_either_cap(events: list, declared: int | None) -> None:
    """Any sequence of hellos, goodbyes and registrations: each key's names stay within its cap and its
    bytes within ``max_bytes`` (the shells take only what the machine admits)."""
    lim = KeyLimits(4 * NAME_BYTES, 3)
    a = Admission(lim)
    held: dict[str, list[tuple[int, int]]] = {KEY: [], OTHER: []}
    for kind, key, n, size in events:
        if kind == "hello":
            if a.hello(key, n, size, declared, held[key]) == "":
                a.add(key, n, size)
        elif kind == "bye":
            a.remove(key, n)
        elif a.register(key, held[key], size) == "":
            held[key].append((1, size))
        for k in (KEY, OTHER):
            assert a.names(k) <= names_cap(lim, declared)
            assert a.held(k, held[k]) <= lim.max_bytes


def _drive(pre: admission.PreAuth, addr: str, proven: set[int]) -> list[int]:
    """What the gate does after an accept: past its handshake counts as proven, else the oldest is shut."""
    shut = []
    while (conn := pre.over(addr)) is not None:
        if conn in proven:
            pre.proven(conn)
        else:
            pre.shut(conn)
            shut.append(conn)
    return shut


def test_preauth_keeps_the_newest_per_address_and_shuts_the_oldest() -> None:
    pre = admission.PreAuth(3)
    for fd in range(10, 13):
        pre.accepted(fd, "a")
        assert _drive(pre, "a", set()) == []
    pre.accepted(13, "a")
    assert _drive(pre, "a", set()) == [10]  # the oldest goes, the newest (maybe a real D) stays
    assert pre.pending("a") == [11, 12, 13]
    pre.accepted(20, "b")  # another address has its own
    assert _drive(pre, "b", set()) == [] and pre.pending("b") == [20]
    pre.accepted(14, "a")
    assert _drive(pre, "a", {11}) == []  # 11 proved its key by now: no longer counted, nothing to shut
    assert pre.pending("a") == [12, 13, 14] and pre.shut_total == 1
    pre.accepted(15, "a")
    assert _drive(pre, "a", set()) == [12] and pre.shut_total == 2
    pre.closed(13)
    pre.accepted(13, "b")  # a descriptor number reused for another address
    assert pre.pending("a") == [14, 15] and pre.pending("b") == [20, 13]


@given(st.lists(st.tuples(st.sampled_from(["accept", "close", "prove"]), st.integers(0, 30), st.sampled_from("ab"))))
@settings(max_examples=300, deadline=None)
def test_preauth_never_keeps_more_than_per_address(events: list) -> None:
    pre = admission.PreAuth(4)
    open_: dict[int, str] = {}
    for kind, fd, addr in events:
        if kind == "accept":
            pre.accepted(fd, addr)
            open_[fd] = addr
            for conn in _drive(pre, addr, set()):
                open_.pop(conn)
        elif kind == "close":
            pre.closed(fd)
            open_.pop(fd, None)
        else:
            pre.proven(fd)
        for a in "ab":
            assert len(pre.pending(a)) <= 4
            assert set(pre.pending(a)) <= {f for f, x in open_.items() if x == a}


def test_key_conns_shut_the_keys_oldest_beyond_its_cap_and_never_another_keys() -> None:
    conns = admission.KeyConns({KEY: 2, OTHER: 3}.__getitem__)
    assert conns.tied(10, KEY, 0.0) == [] and conns.tied(11, KEY, 0.0) == []
    assert conns.tied(20, OTHER, 0.0) == []
    assert conns.tied(12, KEY, 0.0) == [10]  # the oldest goes (a restarted D's half-open one), the new one stays
    assert conns.count(KEY) == 2 and conns.key_of(10) is None and conns.key_of(12) == KEY
    conns.closed(11)
    assert conns.tied(13, KEY, 0.0) == [] and conns.count(OTHER) == 1 and conns.shut_total == 1
    conns.closed(13)
    assert conns.tied(13, OTHER, 0.0) == []  # a descriptor number reused by another key's connection
    assert conns.count(KEY) == 1 and conns.count(OTHER) == 2


def test_a_key_over_its_cap_more_than_its_cap_times_is_barred_for_a_while_and_no_other_key() -> None:
    conns = admission.KeyConns({KEY: 2, OTHER: 2}.__getitem__, barred_s=10.0)
    for fd in (1, 2):
        assert conns.handshake(KEY, 0.0) == "" and conns.tied(fd, KEY, 0.0) == []
    assert conns.handshake(KEY, 1.0) == "" and conns.tied(3, KEY, 1.0) == [1]  # replacements: its cap of them
    assert conns.handshake(KEY, 2.0) == "" and conns.tied(4, KEY, 2.0) == [2]
    why = conns.handshake(KEY, 3.0)  # a third would be one more than its cap within 10 s: barred, before a tie
    assert why == (
        f"D key {KEY[:8]}… is barred for 10.0 s more: it went over its connection cap (2) again and again (2 of "
        "its connections shut over it within 10 s, and one more would have been; its connections open stay)"
    )
    assert conns.count(KEY) == 2 and conns.shut_total == 2 and conns.barred(KEY, 3.0) == 10.0
    conns.closed(3)  # below its cap now, and still barred: the bar is a while, not a count
    assert "barred for 5.0 s more" in conns.handshake(KEY, 8.0)
    assert conns.handshake(OTHER, 8.0) == ""  # another key is not barred with it
    assert conns.handshake(KEY, 13.0) == "" and conns.barred(KEY, 13.0) == 0.0  # the while is over
    assert conns.tied(5, KEY, 13.0) == [] and conns.barred_total == 2


def test_a_zeromq_client_reconnecting_over_its_cap_costs_p_a_few_handshakes() -> None:
    """The gate's loop with a ZeroMQ client of 48 connections and a cap of 4, for a simulated minute: each
    connection P shuts comes back 0.1 s later, each one refused in its handshake stops (as ZeroMQ does). P
    checks about one handshake per connection, where it checked one per reconnection (thousands) unbarred."""

    def run(barred_s: float) -> tuple[int, int]:
        conns = admission.KeyConns(lambda key: 4, barred_s=barred_s)
        due = dict.fromkeys(range(48), 0.0)  # connection -> when it (re)connects
        handshakes = 0
        now = 0.0
        while now < 60.0:
            for fd, at in sorted(due.items()):
                if at > now:
                    continue
                del due[fd]
                handshakes += 1
                if conns.handshake(KEY, now):
                    continue  # refused: ZeroMQ stops reconnecting this one
                for shut in conns.tied(fd, KEY, now):
                    due[shut] = now + 0.1
            now += 0.01
        return handshakes, conns.shut_total

    handshakes, shut = run(admission.BARRED_S)
    assert handshakes <= 48 + 4 and shut <= 4
    unbarred, shut_unbarred = run(0.0)  # no while: the loop never ends
    assert unbarred > 2_000 and shut_unbarred > 2_000


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["tie", "tie", "close", "wait"]),
            st.integers(0, 20),
            st.sampled_from([KEY, OTHER]),
            st.floats(0.0, 6.0),
        )
    ),
    st.integers(1, 4),
)
@settings(max_examples=300, deadline=None)
def test_key_conns_never_keep_more_than_the_cap_nor_shut_more_than_it_per_while(events: list, cap: int) -> None:
    """Whatever keys do and whenever: a key holds at most its cap, only its own connections are shut, at most
    its cap of them within any ``barred_s``, and a handshake is refused only while its key is barred, which
    begins only where admitting it would have shut one more than that."""
    barred_s = 10.0
    caps = {KEY: cap, OTHER: cap + 1}
    conns = admission.KeyConns(caps.__getitem__, barred_s)
    open_: dict[int, str] = {}  # connection -> its key, as the shell sees them
    shut_at: dict[str, list[float]] = {KEY: [], OTHER: []}
    barred_until = {KEY: -1.0, OTHER: -1.0}
    now = 0.0
    for kind, fd, key, dt in events:
        if kind == "wait":
            now += dt
        elif kind == "close":
            conns.closed(fd)
            open_.pop(fd, None)
        else:
            why = conns.handshake(key, now)
            recent = [t for t in shut_at[key] if t > now - barred_s]
            mine = sum(x == key for x in open_.values())
            if now < barred_until[key]:
                assert why, "barred: refused"
                continue
            if mine >= caps[key] and len(recent) >= caps[key]:
                assert why and conns.barred(key, now) == pytest.approx(barred_s), "one shut more than its cap: barred"
                barred_until[key] = now + barred_s
                continue
            assert why == "", "neither barred nor over: admitted"
            if fd in open_:  # a descriptor number reused: the shell saw the old connection close
                conns.closed(fd)
                del open_[fd]
            open_[fd] = key
            shut = conns.tied(fd, key, now)
            assert fd not in shut  # the connection that just proved its key stays
            for c in shut:
                assert open_.pop(c) == key  # only the same key's connections are shut
            shut_at[key] += [now] * len(shut)
        for k, most in caps.items():
            assert conns.count(k) == sum(x == k for x in open_.values()) <= most
            times = shut_at[k]
            assert all(sum(s <= t < s + barred_s for t in times) <= most for s in times)


@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.floats(0.0, 30.0), st.floats(0.0, 3.0), st.lists(st.booleans(), min_size=8, max_size=8))),
)
@settings(max_examples=200, deadline=None)
def test_a_d_restarting_at_most_twice_within_the_while_is_never_refused(ranks: int, restarts: list) -> None:
    """A D of ``ranks`` ranks (its key's cap twice that) restarts: its ranks connect anew over a few seconds,
    while each connection of its previous life is closed or left half-open (P does not know it is dead).
    However it restarts, as long as no restart begins within ``barred_s`` of the end of the one two before
    it, its key is never refused."""
    barred_s = 10.0
    conns = admission.KeyConns(lambda key: 2 * ranks, barred_s)
    ends: list[float] = []
    at = 0.0
    live: list[int] = []
    fd = 0
    for gap, spread, half_open in restarts[:10]:
        at += gap
        if len(ends) >= 2:  # a microsecond past the while: ``(t + barred_s) - barred_s`` may round below t
            at = max(at, ends[-2] + barred_s + 1e-6)
        for i, c in enumerate(live):  # the previous life: closed, or half-open
            if not half_open[i % 8]:
                conns.closed(c)
        live = []
        for r in range(ranks):  # its ranks connect over ``spread`` seconds
            now = at + spread * r / ranks
            assert conns.handshake(KEY, now) == "", (at, r)
            fd += 1
            conns.tied(fd, KEY, now)
            live.append(fd)
        ends.append(at + spread)
    assert conns.barred_total == 0
