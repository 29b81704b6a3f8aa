"""A D rank's silence counted only while P looked (``kvpush.prefill.liveness``), over any run of looks.

Looks come at arbitrary times (gaps from none to far past the stall bar) and
the peer speaks between them at arbitrary times; at every look the silence
the lookout reports is checked against the run itself:

- it never exceeds the real silence (a look forgives, never invents);
- where no gap since the peer's last word was a stall, it is the real silence;
- where one was, it is counted from the end of the last stall, which is
  reported by the look that ends it, with its length.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvpush.prefill.liveness import Lookout, stall_bar

PEER_DEAD_S = 6.0
BAR = stall_bar(PEER_DEAD_S)

gaps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0625, 1.0, BAR, BAR + 0.0625, PEER_DEAD_S, 8.0]), st.booleans()
    ),  # exact in binary
    max_size=30,
)


@given(gaps, st.integers(0, 100).map(float))
def test_silence_is_counted_only_while_this_side_looked(run: list[tuple[float, bool]], start: float) -> None:
    lookout = Lookout(BAR)
    now, word, looks, resumed = start, start, [start], float("-inf")
    assert lookout.look(now) == 0.0  # the first look ends no stall
    for gap, spoke in run:
        now += gap
        stall = lookout.look(now)
        assert stall == (gap if gap > BAR else 0.0), (gap, stall)
        if stall:
            resumed = now
        looks.append(now)
        silence = lookout.silence(word, now)
        real = now - word
        assert silence <= real
        since_word = [b - a for a, b in itertools.pairwise(looks) if a >= word]
        if not any(g > BAR for g in since_word):
            assert silence == real, (silence, real, since_word)
        else:
            assert silence == now - resumed, (silence, resumed)
        if spoke:
            word = now  # the peer's word, read at this look


def test_a_side_frozen_past_peer_dead_s_does_not_blame_its_peer_at_its_first_look() -> None:
    """P looks every 1/16 s, is frozen for 8 s, then looks before D's queued words are read: D has been
    silent for 8 s in real time but 0 s as P watched, and is dead only if it stays silent for
    ``peer_dead_s`` from there."""
    lookout = Lookout(BAR)
    for i in range(17):
        lookout.look(i / 16)
    word = 1.0
    assert lookout.look(9.0) == 8.0
    assert lookout.silence(word, 9.0) == 0.0
    for i in range(1, 16 * 6 + 2):
        lookout.look(9.0 + i / 16)
        assert (lookout.silence(word, 9.0 + i / 16) > PEER_DEAD_S) == (i > 16 * 6)
