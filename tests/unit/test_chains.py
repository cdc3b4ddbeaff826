"""quilld/tiers/chains.py: which block eviction takes instead of a chain's head."""

from __future__ import annotations

from quilld.tiers.chains import Chains

T = b"\0\0\0\1"


def key(i: int) -> bytes:
    return T + b"k%d" % i


def chain(n: int) -> Chains:
    c = Chains()
    for i in range(n):
        c.added(key(i), T, i, None if i == 0 else i - 1)
    return c


def test_the_tail_goes_before_the_head_and_orphans_before_anything():
    c, every = chain(5), (lambda k: True)
    assert c.victim(key(0), every) == key(4)
    c.removed(key(4))
    assert c.victim(key(0), every) == key(3)
    c.added(key(6), T, 6, 5)  # its parent was never stored: nothing can load it
    assert c.victim(key(0), every) == key(6)
    assert c.victim(key(0), lambda k: k != key(6)) == key(3)  # a pinned orphan is passed over


def test_a_removed_middle_block_orphans_its_children_until_it_is_back():
    c = chain(5)
    c.removed(key(2))
    assert list(c.orphans) == [key(3)] and c.victim(key(0), lambda k: True) == key(3)
    c.added(key(2), T, 2, 1)  # stored again: it adopts its child
    assert not c.orphans and c.victim(key(0), lambda k: True) == key(4)


def test_a_block_not_in_a_chain_or_a_pinned_tail_is_its_own_victim():
    c = chain(3)
    assert c.victim(T + b"plain", lambda k: True) == T + b"plain"
    assert c.victim(key(0), lambda k: k != key(2)) == key(0)
    other = T[:-1] + b"\2"  # another scope: the same hashes are other blocks
    c.added(other + b"x", other, 1, 0)
    assert list(c.orphans) == [other + b"x"]
