"""``WebConfig``: the web edge's options, each flag field its own ``stagecast web`` flag.

``web.cli`` adds the flags with ``stagecast.flags.add_flags``, builds the options with ``from_args`` and fills what
the flags only name (the ICE servers from ``--turn``, the host candidates from ``--host``); a launcher writes a web
edge's command line with ``stagecast.flags.to_argv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stagecast.flags import flag
from stagecast.service import csv_list

if TYPE_CHECKING:
    from aiortc import RTCIceServer


@dataclass
class WebConfig:
    gateway: str = flag(help="host:port of the gateway's public API", required=True)
    host: str = flag("127.0.0.1", help="address the page (HTTP) binds")
    port: int = flag(8080, help="HTTP port (0: any free port)")
    # host candidates to offer (empty: aioice's choice); None until the CLI derives them from ``host``
    ice_hosts: list[str] | None = flag(
        name="--ice-host",
        type=csv_list(str),
        help="addresses offered as WebRTC host candidates, where media sockets bind (default: --host unless it is"
        " a wildcard, then every interface but loopback)",
    )
    turn: str | None = flag(help="TURN server for peers that cannot reach --ice-host (turn:HOST:PORT)")
    turn_username: str | None = flag(help="TURN username")
    turn_credential_file: str | None = flag(help="file holding the TURN credential")
    # bearer-token file (the gateway's), or None: anyone may use the page
    tokens: str | None = flag(help="bearer-token file (the gateway's): a browser must send one")
    allow_anonymous: bool = flag(
        False,
        action="store_true",
        help="serve without --tokens on an address other than loopback (anyone who reaches it may generate)",
    )
    tls_cert: str | None = flag(help="the page TLS certificate (PEM)")
    tls_key: str | None = flag(help="the page's TLS key (PEM)")
    gateway_tls: bool = flag(False, action="store_true", help="the gateway speaks TLS (system roots)")
    gateway_ca: str | None = flag(help="PEM file of the CA of the gateway's TLS certificate")
    # the name in the gateway's certificate, when the address is another
    gateway_tls_name: str | None = flag(
        help="the name the gateway's TLS certificate holds, when --gateway addresses it otherwise (e.g. 127.0.0.1)"
    )
    max_peers: int = flag(4, help="browsers connected at once (WebRTC and WebSocket)")
    peer_timeout: float = flag(5.0, help="seconds of silence after which a peer is gone")
    # with tokens, peers of one tenant (0: half of max_peers, at least 1)
    max_peers_per_tenant: int = flag(
        0, help="with --tokens, browsers of one tenant connected at once (0: half of --max-peers, at least 1)"
    )
    max_preauth: int = flag(
        16, help="WebSockets waiting to authenticate (token in their first message, within 1 s), together"
    )
    max_preauth_per_address: int = flag(
        8,
        help="of those, from one client address; when all are taken, a newcomer below its fair share evicts the "
        "oldest socket of the address holding the most",
    )
    # Peers whose X-Forwarded-For names the client address (stagecast.client_identity): the fleet's door
    trusted_proxy: tuple = flag(
        (),
        action="append",
        metavar="ADDR",
        help="a proxy (address or network) whose X-Forwarded-For address is the client's, for the pre-auth pool; "
        "repeatable or a comma list",
    )
    ice_servers: list[RTCIceServer] = field(default_factory=list)  # TURN (or STUN) for peers behind NAT: from --turn
    connect_timeout: float = 15.0  # an answered peer must connect within this
