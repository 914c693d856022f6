"""One contract, every backend, real servers: the properties the HA beat relies on."""

from __future__ import annotations

import time

from taskplatform.backends.base import Lease
from taskplatform.backends.redlock import RedlockLockBackend
from tests.helpers import race, wait_for


def test_a_free_lock_is_granted_with_a_positive_token(backend, lock_name):
    lease = backend.acquire(lock_name, 5, identity="beat-a")
    assert lease is not None and lease.token >= 1 and lease.owner.startswith("beat-a#")
    assert 0 < lease.remaining() <= 5
    info = backend.inspect(lock_name)
    assert info.owner == lease.owner and info.token == lease.token


def test_a_held_lock_is_refused_to_everyone_else(backend, lock_name):
    assert backend.acquire(lock_name, 5, identity="a") is not None
    assert backend.acquire(lock_name, 5, identity="b") is None
    assert backend.acquire(lock_name, 5, identity="a") is None  # a new acquisition, even by the same identity


def test_only_one_of_many_concurrent_contenders_wins(backend, lock_name):
    def contend(i: int, start) -> Lease | None:
        start()
        return backend.acquire(lock_name, 10, identity=f"c{i}")

    grants = [lease for lease in race(6, contend) if lease is not None]
    assert len(grants) <= 1, "two contenders hold the lock at once"
    if isinstance(backend, RedlockLockBackend) and not grants:
        # Redlock's known split vote: every contender won a minority of the nodes, and each
        # undid its partial grants. Nobody holds it, and the next contender must get it.
        info = backend.inspect(lock_name)
        assert info is None or info.owner is None
        assert backend.acquire(lock_name, 10, identity="after-the-split") is not None
    else:
        assert len(grants) == 1


def test_an_expired_lease_is_granted_again_with_a_larger_token(backend, lock_name):
    first = backend.acquire(lock_name, 0.5, identity="a")
    assert first is not None
    second = wait_for(lambda: backend.acquire(lock_name, 5, identity="b"), timeout=10, interval=0.05, what="expiry")
    assert second.token > first.token


def test_renewal_keeps_the_lease_and_renewal_after_expiry_fails(backend, lock_name):
    lease = backend.acquire(lock_name, 1.0, identity="a")
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # renew well within the TTL for 2.5 s: never lost
        lease = backend.renew(lease, 1.0)
        assert lease is not None
        assert backend.acquire(lock_name, 1.0, identity="b") is None
        time.sleep(0.2)  # the holder's own renewal cadence, not synchronisation
    wait_for(lambda: lease.remaining() <= 0, timeout=5, what="local expiry")
    wait_for(lambda: backend.inspect(lock_name).owner is None, timeout=5, what="server-side expiry")
    assert backend.renew(lease) is None  # expired, even though nobody took it


def test_release_by_a_non_owner_fails_and_changes_nothing(backend, lock_name):
    lease = backend.acquire(lock_name, 5, identity="a")
    forged = Lease(lock_name, "intruder#123", lease.token, 5, time.monotonic())
    assert backend.release(forged) is False
    assert backend.renew(forged) is None
    assert backend.inspect(lock_name).owner == lease.owner
    assert backend.release(lease) is True
    assert backend.inspect(lock_name).owner is None
    assert backend.release(lease) is False  # twice: nothing left to release


def test_fencing_tokens_strictly_increase_across_owners_and_releases(backend, lock_name):
    tokens = []
    for i in range(5):
        lease = backend.acquire(lock_name, 5, identity=f"owner{i}")
        assert lease is not None
        tokens.append(lease.token)
        assert backend.release(lease)
    assert tokens == sorted(set(tokens)) and len(tokens) == 5


def test_force_release_frees_the_lock_and_the_old_owner_cannot_renew(backend, lock_name):
    lease = backend.acquire(lock_name, 30, identity="stuck")
    assert backend.force_release(lock_name) is True
    assert backend.renew(lease) is None
    successor = backend.acquire(lock_name, 5, identity="next")
    assert successor is not None and successor.token > lease.token
    assert backend.force_release(f"{lock_name}-never-used") is False


def test_locks_lists_what_is_held(backend, lock_name):
    lease = backend.acquire(lock_name, 5, identity="a")
    listed = {info.name: info for info in backend.locks()}
    assert listed[lock_name].owner == lease.owner and listed[lock_name].token == lease.token


def test_acquire_any_is_a_semaphore_over_its_names(backend, lock_name):
    """The slots of a fleet-wide limit: each grant a distinct name, none once all are held,
    a released one granted again, and an expired one too."""
    names = [f"{lock_name}:{i}" for i in range(3)]
    grants = [backend.acquire_any(names, 5, identity=f"h{i}") for i in range(3)]
    assert all(grants) and len({g.name for g in grants}) == 3
    assert backend.acquire_any(names, 5, identity="late") is None
    assert backend.release(grants[1])
    again = backend.acquire_any(names, 5, identity="next")
    assert again is not None and again.name == grants[1].name and again.token > grants[1].token
    assert backend.acquire_any([], 5) is None
    short = [f"{lock_name}:short"]
    assert backend.acquire_any(short, 0.5, identity="a") is not None
    assert wait_for(lambda: backend.acquire_any(short, 5, identity="b"), timeout=10, interval=0.05, what="expiry")


def test_acquire_any_concurrent_contenders_never_share_a_slot(backend, lock_name):
    names = [f"{lock_name}:{i}" for i in range(2)]

    def contend(i: int, start) -> Lease | None:
        start()
        return backend.acquire_any(names, 10, identity=f"c{i}")

    grants = [lease for lease in race(6, contend) if lease is not None]
    assert len(grants) <= 2 and len({g.name for g in grants}) == len(grants), "two holders of one slot"
    if not isinstance(backend, RedlockLockBackend):  # Redlock may split its votes (see above)
        assert len(grants) == 2
