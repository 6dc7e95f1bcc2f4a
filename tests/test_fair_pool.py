"""Fair eviction from a full pool (stagecast.fair_pool) and who a client is (stagecast.client_identity): the rule the
gateway's pending calls and the web edge's pre-auth sockets share."""

from __future__ import annotations

import pytest

from stagecast.client_identity import client_address, client_key, peer_ip, peer_is_trusted, trusted_proxies
from stagecast.fair_pool import FairPool, PoolFull

pytestmark = pytest.mark.unit


def pool(total=6, per_client=6):
    return FairPool(total, per_client, flag="--max-x", per_client_flag="--max-x-per-client", what="calls")


def test_a_newcomer_to_a_full_pool_evicts_the_oldest_entry_of_the_client_holding_the_most():
    p = pool()
    evicted = []
    a = [p.enter("a", on_evict=lambda i=i: evicted.append(("a", i))) for i in range(4)]
    b = [p.enter("b", on_evict=lambda i=i: evicted.append(("b", i))) for i in range(2)]
    assert len(p) == 6
    p.enter("c")  # below its fair share (6 / 3 clients): a, holding 4, gives up its oldest
    assert evicted == [("a", 0)] and a[0].evicted and not a[0].held and len(p) == 6
    p.enter("c")
    assert evicted == [("a", 0), ("a", 1)]
    with pytest.raises(PoolFull, match="c already holds its fair share"):  # 2 of 6 among 3 clients
        p.enter("c")
    p.enter("d")  # a and b hold 2 each: the tie goes to the client whose oldest entry is oldest, a
    assert evicted[-1] == ("a", 2)
    assert p.held() == {"a": 1, "b": 2, "c": 2, "d": 1}
    assert not any(e.evicted for e in b)
    p.leave(a[0])  # leaving an evicted entry changes nothing
    assert len(p) == 6 and p.evictions == 3


def test_a_client_at_its_fair_share_is_refused_and_equal_holders_never_evict_each_other():
    p = pool(total=4)
    for client in "aabb":
        p.enter(client)
    with pytest.raises(PoolFull, match=r"at most 4 at once \(--max-x\), and a already holds its fair share"):
        p.enter("a")
    p2 = pool(total=3)
    for client in "abc":
        p2.enter(client)
    with pytest.raises(PoolFull, match="no client holds more than its fair share"):  # evicting would move the hole
        p2.enter("d")
    assert p2.held() == {"a": 1, "b": 1, "c": 1}


def test_the_per_client_quota_refuses_before_the_pool_and_leaving_gives_the_place_back():
    p = pool(total=6, per_client=2)
    first = p.enter("a")
    p.enter("a")
    with pytest.raises(PoolFull, match=r"quota: a already holds 2 calls, its quota \(--max-x-per-client 2\)"):
        p.enter("a")
    p.leave(first)
    p.leave(first)  # twice is harmless
    assert p.held() == {"a": 1}
    p.enter("a")


def test_140_idle_entries_from_10_clients_leave_a_newcomer_served_every_time():
    p = pool(total=128, per_client=32)
    entries = []
    for i in range(140):
        try:
            entries.append(p.enter(f"idle-{i % 10}"))
        except PoolFull:
            pass
    assert len(p) == 128
    served = 0
    for _ in range(20):  # another client's calls, each leaving once served
        mine = p.enter("honest")
        served += 1
        p.leave(mine)
    assert served == 20 and max(p.held().values()) <= 13


@pytest.mark.parametrize("bad", [(0, 1), (1, 0), (100_001, 1)])
def test_bounds_out_of_range_name_their_flag(bad):
    with pytest.raises(ValueError, match="--max-x"):
        pool(*bad)


def test_a_client_is_its_tenant_else_its_address_not_its_connection():
    assert client_key("alice", "ipv4:10.0.0.7:51234") == "tenant 'alice'"
    assert client_key(None, "ipv4:10.0.0.7:51234") == client_key(None, "ipv4:10.0.0.7:40000") == "address 10.0.0.7"
    assert peer_ip("ipv6:[::1]:5000") == "::1" and peer_ip("ipv6:%5B::1%5D:5000") == "::1"
    assert peer_ip("::ffff:127.0.0.2") == "127.0.0.2" and peer_ip("127.0.0.3") == "127.0.0.3"
    assert peer_ip("unix:/tmp/socket") is None
    assert client_key(None, "unix:/tmp/socket") == "address unix:/tmp/socket"


def test_behind_a_trusted_proxy_the_client_is_the_address_it_forwarded_for():
    door = trusted_proxies(["10.0.0.5", "10.1.0.0/16,192.168.0.1"])
    # The door appended the viewer's address; what the viewer wrote to the left is not believed.
    assert client_address("ipv4:10.0.0.5:4000", "1.1.1.1, 203.0.113.9", door) == "203.0.113.9"
    # Two trusted hops: read from the right past both.
    assert client_address("10.0.0.5", "203.0.113.9, 10.1.2.3", door) == "203.0.113.9"
    # No header from the door: the door itself.
    assert client_address("10.0.0.5", None, door) == "10.0.0.5"
    # A peer that is not a trusted proxy cannot choose its identity with the header.
    assert client_address("ipv4:198.51.100.4:1", "203.0.113.9", door) == "198.51.100.4"
    assert client_address("10.0.0.5", "garbage", door) == "10.0.0.5"
    assert peer_is_trusted("ipv4:10.1.9.9:4000", door) and peer_is_trusted("ipv6:[::ffff:10.0.0.5]:1", door)
    assert not peer_is_trusted("ipv4:198.51.100.4:1", door) and not peer_is_trusted("unix:/tmp/s", door)
    assert not peer_is_trusted("ipv4:10.0.0.5:4000", ())
    with pytest.raises(ValueError, match="--trusted-proxy: 'door' is not an IP address"):
        trusted_proxies(["door"])
