"""The web edge's peer slots (per tenant, within --max-peers) and its pre-auth pool (per address, within a total)."""

import pytest

from web.slots import PeerSlots, PreAuthPool


@pytest.mark.unit
def test_a_tenant_holds_at_most_its_share_of_the_peers_and_a_freed_slot_comes_back():
    slots = PeerSlots(max_peers=4, per_tenant=2)
    assert slots.take("a1", "alice") is None and slots.take("a2", "alice") is None
    refusal = slots.take("a3", "alice")
    assert "tenant 'alice'" in refusal and "--max-peers-per-tenant" in refusal
    assert slots.take("b1", "bob") is None and slots.take("b2", "bob") is None
    assert "too many peers: 4 connected, the limit is 4" == slots.take("c1", "carol")
    slots.free("a1")
    slots.free("a1")  # freeing twice frees once
    assert len(slots) == 3 and slots.take("a3", "alice") is None


@pytest.mark.unit
def test_without_tokens_only_the_peer_limit_applies():
    slots = PeerSlots(max_peers=3, per_tenant=1)
    assert [slots.take(f"p{i}", None) for i in range(3)] == [None] * 3
    assert "the limit is 3" in slots.take("p3", None)


@pytest.mark.unit
def test_the_pre_auth_pool_is_bounded_per_address_and_in_total():
    pool = PreAuthPool(total=3, per_address=2)
    first, second = pool.enter("10.0.0.1"), pool.enter("10.0.0.1")
    assert not isinstance(first, str) and not isinstance(second, str)
    assert "--max-preauth-per-address" in pool.enter("10.0.0.1")
    assert not isinstance(pool.enter("10.0.0.2"), str)
    refused = pool.enter("10.0.0.2")  # at its fair share of a full pool
    assert "--max-preauth" in refused and "fair share" in refused
    pool.leave(first)
    assert len(pool) == 2 and not isinstance(pool.enter("10.0.0.3"), str)


@pytest.mark.unit
def test_a_full_pre_auth_pool_gives_a_new_address_the_oldest_socket_of_the_address_holding_the_most():
    pool = PreAuthPool(total=4, per_address=3)
    closed = []
    held = [pool.enter("10.0.0.1", lambda i=i: closed.append(i)) for i in range(3)]
    pool.enter("10.0.0.2")
    newcomer = pool.enter("10.0.0.3")
    assert not isinstance(newcomer, str) and closed == [0] and held[0].evicted
    assert len(pool) == 4 and pool.evictions == 1
    pool.leave(held[0])  # the evicted socket's own close: nothing more to give back
    assert len(pool) == 4


@pytest.mark.unit
@pytest.mark.parametrize(
    "make, flag",
    [
        (lambda: PeerSlots(0, 1), "--max-peers"),
        (lambda: PeerSlots(4, 0), "--max-peers-per-tenant"),
        (lambda: PreAuthPool(0, 1), "--max-preauth"),
        (lambda: PreAuthPool(4, 5), "--max-preauth-per-address"),
    ],
)
def test_a_bound_out_of_range_is_refused_naming_its_flag(make, flag):
    with pytest.raises(ValueError, match=flag):
        make()
