"""``stagecast web``: the browser page, WebRTC and the WebSocket fallback in front of a gateway.

Usage::

    stagecast web --gateway 127.0.0.1:50051 --port 8080                 # http://127.0.0.1:8080/
    stagecast web --gateway gw:50051 --host 0.0.0.0 --tokens tokens --tls-cert page.crt --tls-key page.key \\
        --ice-host 10.0.0.7 --turn turn:turn.example.com:3478 --turn-username u --turn-credential-file cred

It prints ``STAGECAST_READY web url=... address=...`` once it serves; SIGTERM or Ctrl-C closes every peer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl

from stagecast.flags import HelpFormatter, add_flags, from_args
from stagecast.service import announce_ready
from web.options import WebConfig

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "web",
        help="serve the live browser page (WebRTC, WebSocket fallback) in front of a gateway",
        formatter_class=HelpFormatter,
    )
    add_flags(p, WebConfig)  # its flags: web.options
    p.set_defaults(run=main)


def ice_hosts(host: str, explicit: list[str] | None) -> list[str]:
    if explicit is not None:
        return explicit
    return [] if host in ("0.0.0.0", "::", "") else [host]


def main(args: argparse.Namespace) -> int:
    from aiortc import RTCIceServer

    from stagecast.client_identity import trusted_proxies
    from stagecast.security import is_loopback
    from web.server import WebApp
    from web.slots import PeerSlots, PreAuthPool

    if not args.tokens and not args.allow_anonymous and not is_loopback(args.host):
        print(
            f"stagecast web: --host {args.host} is reachable from other machines: give --tokens FILE "
            "(or --allow-anonymous)",
            flush=True,
        )
        return 2
    if args.max_peers < 1 or args.peer_timeout <= 0:
        print("stagecast web: --max-peers must be >= 1 and --peer-timeout > 0", flush=True)
        return 2
    servers = []
    if args.turn:
        credential = None
        if args.turn_credential_file:
            with open(args.turn_credential_file) as f:
                credential = f.read().strip()
        servers.append(RTCIceServer(urls=args.turn, username=args.turn_username, credential=credential))
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            print("stagecast web: --tls-cert and --tls-key go together", flush=True)
            return 2
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    cfg = from_args(WebConfig, args, ice_hosts=ice_hosts(args.host, args.ice_hosts), ice_servers=servers)
    try:
        PeerSlots(cfg.max_peers, cfg.max_peers_per_tenant or 1)
        PreAuthPool(cfg.max_preauth, cfg.max_preauth_per_address)
        trusted_proxies(cfg.trusted_proxy)
    except ValueError as exc:
        print(f"stagecast web: {exc}", flush=True)
        return 2

    async def serve() -> None:
        app = WebApp(cfg)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            url = await app.start(args.host, args.port, tls)
        except OSError as exc:
            print(f"stagecast web: port {args.port}: {exc.strerror}", flush=True)
            raise SystemExit(1) from None
        address = url.split("://", 1)[1].rstrip("/")
        print(f"stagecast web: open {url}", flush=True)
        announce_ready("web", url=url, address=address)
        await stop.wait()
        # Stopping: later SIGTERMs (a launcher sends two) are ignored.  asyncio.run closes the loop's self-pipe before
        # it resets the signal wakeup fd, and a signal arriving between the two printed a traceback ("Exception ignored
        # when trying to write to the signal wakeup fd"); removing the handlers now resets it while the pipe is open.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        await app.stop()

    asyncio.run(serve())
    return 0
