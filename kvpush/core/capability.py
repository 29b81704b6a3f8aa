"""Capabilities: what binds a transfer to the D the router chose (pure: bytes in, verdicts out).

A transfer id names a transfer; it is no secret (it travels in logs, metrics
and request ids, and without a router-supplied id it is vLLM's request id).
A *capability* is the secret that goes with it: ``HMAC-SHA256(K, transfer
id)`` cut to 128 bits, hex. P accepts a registration, a re-registration or an
abort of a transfer only with it, so knowing the id (or holding a D key) is
not enough to take a transfer or kill it.

Who holds ``K``: the P fleet, which derives it from P's secret CURVE key
(``derive_key``; every P rank of every P instance holds that key already),
and the router, which gets ``K`` alone (``kvpush keys DIR`` writes it to
``DIR/router/capability.key``; ``K`` does not reveal P's secret key). So:

* a sequential router (vllm-router, Ray Serve, ``kvpush router`` P-first)
  passes P's ``kv_transfer_params`` on to D; P's answer carries the
  capability P minted for the transfer;
* a concurrent router (``kvpush router``) sends P and D at once; D registers
  before P has answered, so the router mints the same capability itself and
  sends it to D. P verifies statelessly whichever came first: no state, no
  order between P's request and D's registration.

Why an HMAC and not a random capability the router sends to both: P would
have to learn it from its own request before checking a registration that
may arrive first, so it would hold unverified registrations (from any key)
until then; the HMAC is checked at once, on the frame that carries it.

A sub-request of a request with several prompts has its own transfer id
(``<shared>/<prompt>.<child>``, ``sub_request_id``; ``kvpush.integrations.vllm.params``
derives it on P and D); the capability of the shared id covers them (D knows
only the shared one), and only them: the ids ``sub_request_id`` makes, in
ASCII digits without leading zeros (``shared_id``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from dataclasses import dataclass

CAPABILITY_CHARS = 32
"""A capability's length: 128 bits as lowercase hex."""
_LABEL = b"kvpush capability key v1"
_INDEX = "(?:0|[1-9][0-9]*)"
_SUB = re.compile(rf"(.+)/({_INDEX})\.({_INDEX})", re.DOTALL)


def sub_request_id(shared: str, prompt: int, child: int) -> str:
    """The transfer id of sub-request (``prompt``, ``child``) of a request whose transfer id is ``shared``: the
    shared id itself for the first (0, 0), so a single-prompt request carries it unchanged."""
    if prompt < 0 or child < 0:
        raise ValueError(f"a sub-request's prompt and child are counts from 0, got {prompt}.{child}")
    return shared if (prompt, child) == (0, 0) else f"{shared}/{prompt}.{child}"


def shared_id(transfer_id: str) -> str | None:
    """The shared id ``transfer_id`` is a sub-request's id of (None: it is no sub-request's), so that exactly
    the ids ``sub_request_id`` makes are covered by their shared id's capability: the indexes in ASCII digits
    (a regular expression's ``\\d`` also takes other scripts' digits, as Arabic-Indic ``A/\\u0661.\\u0662``,
    which no P derives), without leading zeros, nothing after them (``$`` would let a newline follow), and
    not ``0.0``."""
    m = _SUB.fullmatch(transfer_id)
    if m is None or (m.group(2), m.group(3)) == ("0", "0"):
        return None
    return m.group(1)


def derive_key(p_secret: bytes) -> bytes:
    """``K`` from P's secret CURVE key (Z85 text): the same on every P rank and P instance of a fleet."""
    return hmac.new(p_secret, _LABEL, hashlib.sha256).digest()


def mint(key: bytes, transfer_id: str) -> str:
    """The capability of ``transfer_id``."""
    return hmac.digest(key, transfer_id.encode(), "sha256")[: CAPABILITY_CHARS // 2].hex()


MINTED_KEPT = 4096
"""Capabilities P keeps once minted (``_kept``, least recently used out first): a few hundred bytes each."""


@functools.lru_cache(maxsize=MINTED_KEPT)
def _kept(key: bytes, transfer_id: str) -> str:
    """``mint``, remembered: P mints the capability of a prefill when it is handed over
    (``Binding.expect``), so that checking the registration that comes after it is a comparison. On a
    thread that just woke, after host copies evicted the caches, one HMAC costs tens of microseconds."""
    return mint(key, transfer_id)


def valid(key: bytes, transfer_id: str, capability: str) -> bool:
    """Whether ``capability`` is ``transfer_id``'s (or its shared id's, for a sub-request); constant time."""
    if not capability:
        return False
    if hmac.compare_digest(_kept(key, transfer_id), capability):
        return True
    shared = shared_id(transfer_id)
    return shared is not None and hmac.compare_digest(_kept(key, shared), capability)


@dataclass(frozen=True)
class Binding:
    """P's rule for capabilities: ``key`` is the fleet's ``K``; ``required`` False accepts registrations and
    aborts without one (routers that cannot pass one: vLLM's push proxies), a capability given must still
    be valid, and a registration with a valid one takes a transfer from a key that registered without."""

    key: bytes
    required: bool = True

    def expect(self, transfer_id: str) -> None:
        """Mint ``transfer_id``'s capability (and its shared id's, for a sub-request) ahead of the
        registration that will carry it (``_kept``); the check itself is unchanged."""
        _kept(self.key, transfer_id)
        shared = shared_id(transfer_id)
        if shared is not None:
            _kept(self.key, shared)

    def check(self, transfer_id: str, capability: str, what: str) -> str:
        """Why ``what`` ("registration", "abort") of ``transfer_id`` is refused ("" if it is not).
        The reason never contains the capability."""
        if not capability:
            if not self.required:
                return ""
            return (
                f"the {what} carries no capability, and this P requires one (D passes the capability of "
                "P's kv_transfer_params, or the router's; docs/security.md)"
            )
        if not valid(self.key, transfer_id, capability):
            return f"the {what}'s capability is not this transfer's"
        return ""
