"""Who a caller is, for quotas and fair eviction: the one rule the gateway and the web edge share.

Usage::

    trusted = trusted_proxies(["10.0.0.5", "10.1.0.0/16"])      # --trusted-proxy (ValueError names the flag)
    client_key(None, "ipv4:10.0.0.7:51234")                      # -> "address 10.0.0.7"
    client_key("alice", "ipv4:10.0.0.7:51234")                   # -> "tenant 'alice'"
    client_key(None, "10.0.0.5", "203.0.113.9, 10.0.0.5", trusted=trusted)   # -> "address 203.0.113.9"

The rule: a client is its tenant (with tokens, every connection of a tenant counts together), else its peer's
address (the IP, not the port: ten connections from one machine are one client).  Behind a trusted proxy (the
fleet's HAProxy door, ``option forwardfor``) every viewer's connection comes from the proxy, so there the client is
the address the proxy saw: the ``x-forwarded-for`` entry it appended, read from the right, past any other trusted
proxy.  Entries left of that were written by the caller and are never believed; a peer that is not a trusted proxy
cannot pick its identity with the header.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import unquote

FLAG = "--trusted-proxy"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_proxies(values: Iterable[str] | None) -> tuple[Network, ...]:
    """The ``--trusted-proxy`` values (addresses or CIDR networks, each maybe a comma list) as networks."""
    nets = []
    for value in values or ():
        for item in str(value).split(","):
            item = item.strip()
            if not item:
                continue
            try:
                nets.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(
                    f"{FLAG}: {item!r} is not an IP address or network (e.g. 10.0.0.5, 10.1.0.0/16)"
                ) from None
    return tuple(nets)


def peer_ip(peer: str | None) -> str | None:
    """The IP of a peer as gRPC (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``) or aiohttp (``1.2.3.4``) names it;
    IPv4-mapped IPv6 as IPv4; None when it is not an IP address (a Unix socket, or unknown)."""
    if not peer:
        return None
    text = unquote(peer)
    if text.startswith(("ipv4:", "ipv6:")):
        text = text.split(":", 1)[1]
        if text.startswith("["):
            text = text[1:].split("]", 1)[0]
        elif text.count(":") == 1:
            text = text.rsplit(":", 1)[0]
    return _ip(text)


def _ip(text: str) -> str | None:
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _trusted(ip: str | None, trusted: tuple[Network, ...]) -> bool:
    if ip is None or not trusted:
        return False
    addr = ipaddress.ip_address(ip)
    return any(addr in net for net in trusted)


def peer_is_trusted(peer: str | None, trusted: tuple[Network, ...]) -> bool:
    """Whether the peer (gRPC's ``ipv4:10.0.0.5:51234``) is a trusted proxy."""
    return _trusted(peer_ip(peer), trusted)


def client_address(peer: str | None, forwarded_for: str | None = None, trusted: tuple[Network, ...] = ()) -> str:
    """The caller's address by the rule: the peer's IP, or behind a trusted proxy the one it forwarded for."""
    address = peer_ip(peer)
    if _trusted(address, trusted) and forwarded_for:
        for hop in reversed(forwarded_for.split(",")):
            ip = _ip(hop)
            if ip is None:
                break  # not an address: keep the last one a trusted proxy vouched for
            address = ip
            if not _trusted(ip, trusted):
                break
    return address or (peer or "unknown")


def client_key(
    tenant: str | None, peer: str | None, forwarded_for: str | None = None, trusted: tuple[Network, ...] = ()
) -> str:
    """Whose quota and fair share a call counts against: ``tenant 'alice'``, else ``address 10.0.0.7``."""
    if tenant is not None:
        return f"tenant {tenant!r}"
    return f"address {client_address(peer, forwarded_for, trusted)}"
