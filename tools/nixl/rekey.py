"""Does D deregistering (and re-registering) its memory kill the remote keys a P loaded before? Two processes.

D registers a buffer and gives P its metadata; P writes once, builds a second WRITE with the keys it loaded,
then D deregisters the buffer (and, unless ``--no-reregister``, registers the same memory again, as a D that
wanted to revoke every P's keys under vLLM, which keeps the KV tensors, would have to); P posts the second
WRITE. Prints whether it landed. Measured results and what they mean: docs/security.md, "A block is reused
only when no writer can reach it".

    python tools/nixl/rekey.py UCX [--no-reregister]
    eval "$(bash tools/libfabric/setup.sh --env)"
    PYTHONPATH=tests python -c 'import helpers_libfabric as h, os, sys; \
        os.execvpe(sys.executable, [sys.executable, "tools/nixl/rekey.py", "LIBFABRIC"], h.child_env())'

"""

import multiprocessing as mp
import sys
import threading
import time

import numpy as np

N = 16 << 20
ROWS = 16


def d_main(backend, to_p, from_p, out):
    from kvpush.backends.base import MemRegistration
    from kvpush.transport.nixl_agent import Agent

    d = Agent("rk-D", (backend,))
    dst = np.zeros(N, np.uint8)
    reg = [MemRegistration(dst.ctypes.data, N, 0, "DRAM")]
    d.register(reg)
    stop = threading.Event()
    seen = []

    def prog():
        while not stop.wait(1e-3):
            seen.extend(m for _, m in d.notifs())

    t = threading.Thread(target=prog, daemon=True)
    t.start()
    to_p.put((d.metadata(), dst.ctypes.data))
    assert from_p.get(timeout=60) == "w1"
    deadline = time.monotonic() + 10
    while b"w1" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    first = bool((dst == 1).all())
    d.deregister_all()
    if "--no-reregister" not in sys.argv:
        d.register(reg)  # the same memory again: new registration, new keys
    to_p.put("rekeyed")
    res = from_p.get(timeout=60)
    time.sleep(2.0)
    out.put((first, res, int((dst == 2).sum()), b"w2" in seen))
    stop.set()
    t.join()
    d.close()


def p_main(backend, to_p, from_p):
    from kvpush.backends.base import MemRegistration
    from kvpush.transport.nixl_agent import Agent

    p = Agent("rk-P", (backend,))
    src = np.zeros(N, np.uint8)
    p.register([MemRegistration(src.ctypes.data, N, 0, "DRAM")])
    meta, base = to_p.get(timeout=60)
    name = p.add_peer(meta, "rk-D", b"hi")
    local = np.array([(src.ctypes.data + i * N // ROWS, N // ROWS, 0) for i in range(ROWS)], np.int64)
    remote = np.array([(base + i * N // ROWS, N // ROWS, 0) for i in range(ROWS)], np.int64)
    src[:] = 1
    h = p.prepare_write(local, "DRAM", remote, "DRAM", name, b"w1")
    st = p.post(h)
    while st.name == "PROC":
        st = p.state(h)
    p.release(h)
    h2 = p.prepare_write(local, "DRAM", remote, "DRAM", name, b"w2")  # built with the old keys
    from_p.put("w1")
    assert to_p.get(timeout=60) == "rekeyed"
    src[:] = 2
    try:
        st = p.post(h2)
        deadline = time.monotonic() + 10
        while st.name == "PROC" and time.monotonic() < deadline:
            st = p.state(h2)
        res = st.name
    except Exception as exc:
        res = f"raised {type(exc).__name__}: {exc}"[:200]
    from_p.put(res)
    time.sleep(3)


if __name__ == "__main__":
    backend = sys.argv[1]
    ctx = mp.get_context("spawn")
    to_p, from_p, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    d = ctx.Process(target=d_main, args=(backend, to_p, from_p, out))
    p = ctx.Process(target=p_main, args=(backend, to_p, from_p))
    d.start()
    p.start()
    first, res, landed, notified = out.get(timeout=120)
    what = "deregistered" if "--no-reregister" in sys.argv else "re-registered"
    print(
        f"{backend}: first write landed={first}; after D {what}: P's WRITE {res}, "
        f"bytes landed {landed} of {N}, notification delivered={notified}"
    )
    p.join(10)
    d.join(10)
