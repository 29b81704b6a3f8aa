"""``kvpush doctor``: is this host ready to move KV, and if not, why and how to fix it.

Why a command and not a wiki page: the failures that cost operators hours on
P/D fleets are environmental (a NIXL plugin that silently is not there, a
libfabric too old for it, a missing device runtime, a busy port, clocks that
disagree) and each has a precise, checkable cause. The doctor checks each,
says what it found in plain words, and names the fix. Every check is a
``Check`` with a status:

``ok``       works;
``missing``  not available here, which is fine unless you ``--require`` it
             (LIBFABRIC on a host without EFA, CUDA on a CPU host);
``fail``     broken, or missing and required: the exit status is 1.

Checks, a module each: NIXL importable (version, wheel) and each NIXL plugin
(UCX, LIBFABRIC) by creating a throwaway agent in a child process, and for
one that does not load, the reason from the plugin's shared-library
dependencies (``nixl``, ``libfabric``); EFA devices (``efa``); installed
kvpush backends and whether each is usable here (``backends``); a loopback
push through every usable backend (a real ``Sender`` and ``Receiver`` with two
NIXL agents in this process), with byte verification and the bandwidth it
reached (``selftest``); the side-channel port (``--port``, ``port``); the
clock offset to a P side channel (``--peer``, ``clock``). ``report`` holds
``Check`` and the printing, ``command`` the flags and the order of the checks.
"""

from kvpush.doctor.clock import check_clock, measure_clock
from kvpush.doctor.command import DEFAULT_PLUGINS, SELF_TEST_PLUGINS, build_parser, main, run
from kvpush.doctor.device_backends import check_backends
from kvpush.doctor.efa import check_efa, efa_devices
from kvpush.doctor.libfabric import LIBFABRIC_VERSION_NODE, has_version_node
from kvpush.doctor.nixl import check_libfabric, check_nixl, check_plugins, explain_plugin, plugin_dir
from kvpush.doctor.port import check_port
from kvpush.doctor.report import Check, apply_requirements, render
from kvpush.doctor.selftest import SELF_TEST_GEOMETRY, SELF_TEST_TOKENS, self_test

__all__ = [
    "DEFAULT_PLUGINS",
    "LIBFABRIC_VERSION_NODE",
    "SELF_TEST_GEOMETRY",
    "SELF_TEST_PLUGINS",
    "SELF_TEST_TOKENS",
    "Check",
    "apply_requirements",
    "build_parser",
    "check_backends",
    "check_clock",
    "check_efa",
    "check_libfabric",
    "check_nixl",
    "check_plugins",
    "check_port",
    "efa_devices",
    "explain_plugin",
    "has_version_node",
    "main",
    "measure_clock",
    "plugin_dir",
    "render",
    "run",
    "self_test",
]
