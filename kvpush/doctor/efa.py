"""EFA devices: the RDMA devices whose kernel driver is ``efa``, which the LIBFABRIC plugin uses in production.

Read from sysfs rather than from libfabric, so that a host whose libfabric is
missing or broken still gets a true answer about its devices.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvpush.doctor.report import Check


def efa_devices(sys_root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """RDMA devices whose kernel driver is ``efa``."""
    out: list[str] = []
    if not sys_root.is_dir():
        return out
    for dev in sorted(sys_root.iterdir()):
        drv = dev / "device" / "driver"
        try:
            name = os.path.basename(os.readlink(drv))
        except OSError:
            name = ""
        if name == "efa" or (not name and dev.name.startswith("rdmap")):
            out.append(dev.name)
    return out


def check_efa() -> Check:
    """EFA devices on this host (and whether ``fi_info`` sees the efa provider); none is ``missing``, not a failure."""
    devs = efa_devices()
    details: dict[str, Any] = {"devices": devs}
    fi = shutil.which("fi_info")
    if fi is not None:
        proc = subprocess.run([fi, "-p", "efa"], capture_output=True, text=True, timeout=30, check=False)
        details["fi_info_efa"] = proc.returncode == 0 and "provider: efa" in proc.stdout
    if devs:
        return Check("efa", "EFA devices", "ok", f"{len(devs)} EFA device(s): {', '.join(devs)}", details=details)
    rdma = Path("/sys/class/infiniband")
    why = "no RDMA devices at all (no /sys/class/infiniband)" if not rdma.is_dir() else "RDMA devices, none of them EFA"
    return Check(
        "efa",
        "EFA devices",
        "missing",
        "no EFA device",
        why=why + ("" if fi else "; fi_info is not installed either"),
        fix="on AWS, use an EFA-enabled instance type with EFA attached to its interface and the efa kernel "
        "driver loaded (aws-efa-installer); elsewhere use UCX",
        details=details,
    )
