"""kvpush.observability.timeline: records, parsing real-looking logs, joining P with D, the table and the PNG.

Synthetic logs carry known stage lengths and deliberately different clock
offsets per process; the last test joins the lines a real in-process P/D pair
logged over NIXL.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers_local_pair import local_pair

from kvpush.cli import timeline as timeline_cli
from kvpush.core.outcome import Cause, PlanKind, PushStats, PushTimes, ReceiveStats, ReceiveTimes, Result, Stage
from kvpush.observability import timeline

P_OFF = 1_700_000_000.0  # P's wall clock minus its monotonic clock
D_OFF = 1_700_000_000.0 - 3000.0  # D's monotonic clock started 3000 s later (another process, another boot)


def p_res(tid: str, t: float, *, rank_delay: float = 0.0, ok: bool = True) -> Result:
    """P's side, in P's monotonic time; D sent the registration at wall P_OFF + t."""
    ev = PushTimes(
        prefill_done=t - 0.010,  # the prefill was done first: it waited 12 ms for the registration
        registered=t + 0.002,
        push_start=t + 0.003,
        ready=t + 0.003,
        planned=t + 0.005,
        packed=t + 0.005,
        posted=t + 0.006,
        completed=t + 0.036 + rank_delay,
        released=t + 0.037 + rank_delay,
    )
    stats = PushStats(bytes=65536, descriptors=4, plan=PlanKind.DIRECT)
    if ok:
        return Result(tid, f"p-{tid}", True, stats=stats, times=ev)
    return Result(tid, f"p-{tid}", False, "post failed: x", Cause.POST_ERROR, Stage.POST, stats, ev)


def d_res(tid: str, t: float) -> Result:
    """D's side in D's monotonic time (shifted by 3000 s against P's)."""
    t += 3000.0
    ev = ReceiveTimes(registered=t - 0.001, sent=t, completed=t + 0.037, result=t + 0.038)
    return Result(tid, f"d-{tid}", True, stats=ReceiveStats(bytes=65536, descriptors=4, plan=PlanKind.DIRECT), times=ev)


def line(prefix: str, side: str, engine: str, res: Result, off: float) -> str:
    rec = timeline.record(side, engine, res, wall_offset=off)
    return f"{prefix} [kvpush.timeline] {timeline.MARKER}{json.dumps(rec)}\n"


@pytest.fixture
def logs(tmp_path: Path) -> tuple[Path, Path]:
    p_lines = ["INFO 11-30 12:00:00 [api_server.py] Started server process\n"]
    d_lines = ["(EngineCore_DP0 pid=4) DEBUG kvpush worker: finished_sending=set()\n"]
    for i in range(10):
        t = 100.0 + i
        p_lines.append(
            line("(EngineCore_DP0 pid=1) DEBUG 11-30 12:00:01", "prefill", "push-p-0", p_res(f"t{i}", t), P_OFF)
        )
        d_lines.append(line("DEBUG 2026-11-30 12:00:01,5", "decode", "recv-d-0", d_res(f"t{i}", t), D_OFF))
    # TP: a second P rank wrote t0 too, finishing 5 ms later; it is the critical path.
    p_lines.append(line("x", "prefill", "push-p-1", p_res("t0", 100.0, rank_delay=0.005), P_OFF))
    p_lines.append(line("x", "prefill", "push-p-0", p_res("only-p", 200.0), P_OFF))
    d_lines.append(line("x", "decode", "recv-d-0", d_res("only-d", 300.0), D_OFF))
    d_lines.append(f"DEBUG {timeline.MARKER}{{not json\n")
    p_path, d_path = tmp_path / "P.log", tmp_path / "D.log"
    p_path.write_text("".join(p_lines))
    d_path.write_text("".join(d_lines))
    return p_path, d_path


def test_record_converts_to_wall_clock_and_orders_events() -> None:
    rec = timeline.record("decode", "recv-d-0", d_res("x", 0.0), wall_offset=D_OFF)
    assert list(rec["t"]) == ["registered", "sent", "completed", "result"]
    assert rec["t"]["sent"] == pytest.approx(P_OFF)  # same wall instant as P's t=0
    assert rec["plan"] == "direct" and rec["bytes"] == 65536 and rec["side"] == "decode"


def test_parse_and_join(logs: tuple[Path, Path]) -> None:
    recs, bad = [], 0
    for path in logs:
        r, b = timeline.parse_lines(path.read_text().splitlines())
        recs += r
        bad += b
    assert bad == 1 and len(recs) == 10 + 1 + 1 + 10 + 1
    joined, only_p, only_d = timeline.join(recs)
    assert (len(joined), only_p, only_d) == (10, 1, 1)
    j0 = next(j for j in joined if j.transfer_id == "t0")
    assert j0.p_ranks == 2
    stages = {st.name: st.seconds(j0) for st in timeline.STAGES}
    assert stages["d_handshake"] == pytest.approx(0.001, abs=2e-6)
    assert stages["register_delivery"] == pytest.approx(0.002, abs=2e-6)
    assert stages["registration_wait"] == pytest.approx(0.012, abs=2e-6)
    assert stages["rendezvous_wait"] == pytest.approx(0.001, abs=2e-6)
    assert stages["completion"] == pytest.approx(0.035, abs=2e-6)  # the slower rank (+5 ms)
    assert stages["notify"] == pytest.approx(-0.004, abs=2e-6)  # D saw it before rank 1 finished: skew shows
    summary = timeline.summarize(joined)
    assert summary["total"]["n"] == 10
    assert summary["total"]["median"] == pytest.approx(0.039, abs=2e-6)
    assert summary["plan"]["median"] == pytest.approx(0.002, abs=2e-6)


def test_command_prints_table_and_draws_png(logs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    png, js = tmp_path / "w.png", tmp_path / "t.json"
    assert timeline_cli.main([str(logs[0]), str(logs[1]), "--png", str(png), "--json", str(js), "--sample", "4"]) == 0
    out = capsys.readouterr().out
    assert "10 transfers joined (0 failed); 1 only in P's log, 1 only in D's log" in out
    for name in ("registration_wait", "rendezvous_wait", "completion", "total"):
        assert name in out
    assert "the clocks differ" in out  # t0's negative notify span
    assert "t0" in out and "waterfall of 4 transfers" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    payload = json.loads(js.read_text())
    assert payload["only_p"] == 1 and len(payload["transfers"]) == 10


def test_command_fails_without_joinable_lines(tmp_path: Path, capsys) -> None:
    log = tmp_path / "plain.log"
    log.write_text("INFO nothing here\n")
    assert timeline_cli.main([str(log)]) == 1
    assert "KVPUSH_LOG_LEVEL=DEBUG" in capsys.readouterr().err
    assert timeline_cli.main([str(tmp_path / "missing.log")]) == 2


def test_lines_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvpush.timeline"):
        timeline.log_result("prefill", "push-p-0", p_res("quiet", 1.0))
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="kvpush.timeline"):
        timeline.log_result("prefill", "push-p-0", p_res("loud", 1.0))
    recs, bad = timeline.parse_lines(r.getMessage() for r in caplog.records)
    assert bad == 0 and [r["transfer_id"] for r in recs] == ["loud"]


def test_real_engines_log_lines_that_join(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvpush.timeline"), local_pair() as pair:
        pair.push("a", 40, [0, 1, 2], [5, 6, 7])
        pair.push("b", 100, [10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26])
        pair.wait(pair.receiver, 2)
        pair.wait(pair.sender, 2)
    log = tmp_path / "both.log"
    log.write_text("".join(f"DEBUG [kvpush.timeline] {r.getMessage()}\n" for r in caplog.records))
    recs, _ = timeline.parse_lines(log.read_text().splitlines())
    joined, only_p, only_d = timeline.join(recs)
    assert sorted(j.transfer_id for j in joined) == ["a", "b"] and only_p == only_d == 0
    for j in joined:
        assert j.ok and j.bytes > 0
        chain = [j.p[e] for e in ("push_start", "planned", "ready", "packed", "posted", "completed", "released")]
        assert chain == sorted(chain)
        for st in timeline.STAGES:
            v = st.seconds(j)
            # One process, one clock: nothing negative, except that D may see the completion a little
            # before P's polling notices its WRITE done (P's "completed" is when P noticed).
            floor = -0.05 if st.name == "notify" else -1e-5
            assert v is not None and v >= floor, (st.name, v)
        # The joined stages (registration_wait aside, it overlaps) tile D's whole wait exactly.
        tiles = sum(st.seconds(j) for st in timeline.STAGES if st.name != "registration_wait")
        assert tiles == pytest.approx(timeline.TOTAL.seconds(j), abs=1e-5)
