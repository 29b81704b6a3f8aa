"""The side-channel port: every P rank's port must be free before P starts, or that rank cannot listen."""

from __future__ import annotations

import socket

from kvpush.doctor.report import Check


def check_port(host: str, port: int, tp_size: int = 1) -> Check:
    """P rank r binds ``port + r``: every one of them must be free."""
    busy: list[int] = []
    for p in range(port, port + tp_size):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, p))
            except OSError:
                busy.append(p)
    ports = f"{port}" if tp_size == 1 else f"{port}-{port + tp_size - 1}"
    if not busy:
        return Check("port", "side-channel port", "ok", f"{host}:{ports} free")
    return Check(
        "port",
        "side-channel port",
        "fail",
        f"{host}:{', '.join(map(str, busy))} already in use",
        why="another process listens there (a running P, or a previous one not yet gone)",
        fix="stop it, or choose another side_channel_port in kv_connector_extra_config (rank r uses port + r)",
    )
