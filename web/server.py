"""The web process: the live page, WebRTC offer/answer and the WebSocket fallback, in front of one gateway.

Usage::

    app = WebApp(WebConfig(gateway="127.0.0.1:50051", ice_hosts=["127.0.0.1"]))
    url = await app.start("127.0.0.1", 8080)      # -> "http://127.0.0.1:8080/"
    await app.stop()                              # closes every peer: their streams end at the gateway

Routes:

    GET  /                 the page (``web/static``: one HTML file, one script, one stylesheet; no build step)
    GET  /api/info         what the page needs: ICE servers, limits, whether a token is needed
    GET  /api/budget       the gateway's per-stream cost budget (GetStatus), with the page's bearer token: which
                           sizes the page offers
    POST /api/offer        {"sdp": "<offer>", "type": "offer"} -> {"sdp": "<answer>", "type": "answer", "peer": id}
    GET  /api/ws           the WebSocket fallback (``web.fallback``); a token in ``Sec-WebSocket-Protocol:
                           stagecast, bearer.<token>`` or in the first message (never in the URL)
    GET  /healthz          200 while serving

It talks to the gateway only through the public SDK (``stagecast.AsyncClient``), one channel per peer, with the
peer's own bearer token, so tenants and the gateway's limits apply to browser streams as to any other.  With
``tokens`` the web process checks the token itself first (the same file and ``TokenAuth`` as the gateway), so a
stranger costs no WebRTC set-up, and a peer slot is taken only after the token is checked (``web.slots``: slots
per tenant, and a small pre-auth pool, closed after 1 s, for WebSockets that send their token in their first message).
Every refusal is a JSON ``{"error": "..."}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
from pathlib import Path

from aiohttp import web

from stagecast.client import AsyncClient
from stagecast.client_identity import client_address, trusted_proxies
from stagecast.errors import StagecastError
from stagecast.security import TokenAuth
from web.control import MAX_MESSAGE_BYTES
from web.fallback import FIRST_MESSAGE_S, serve_socket
from web.options import WebConfig
from web.rtc import MAX_SDP_BYTES, BadOffer, RtcPeer, use_ice_hosts
from web.session import Session
from web.slots import PREAUTH_S, PeerSlots, PreAuthPool

logger = logging.getLogger(__name__)

BUDGET_TTL_S = 60.0  # the gateway's cost budget is fixed at its start: asked at most once a minute
BUDGET_FIELDS = (
    "max_frame_pixels",
    "max_stream_cost",
    "min_fps",
    "default_width",
    "default_height",
    "default_fps",
    "default_steps",
    "default_passes",
)

STATIC = Path(__file__).resolve().parent / "static"
# A WebSocket may carry its bearer token in its headers as ``Sec-WebSocket-Protocol: stagecast, bearer.<token>`` (a
# browser cannot set Authorization on a WebSocket); the server answers with ``stagecast`` and never echoes the token.
WS_PROTOCOL = "stagecast"
BEARER_PROTOCOL = "bearer."
PAGES = {
    "/": ("index.html", "text/html"),
    "/app.js": ("app.js", "text/javascript"),
    "/app.css": ("app.css", "text/css"),
}
# A socket waiting in a full pre-auth pool whose place went to a newcomer below its fair share is closed with this.
EVICTED = b"no token yet, and the pre-auth pool is full: send the token in Sec-WebSocket-Protocol"
# The page loads nothing from elsewhere (no CDN: the machine may be offline) and runs no inline script.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; media-src 'self' blob:; "
    "connect-src 'self' ws: wss:; frame-ancestors 'none'"
)


def _refuse(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status)


class WebApp:
    def __init__(self, cfg: WebConfig):
        self.cfg = cfg
        self.auth = TokenAuth(cfg.tokens) if cfg.tokens else None
        use_ice_hosts(cfg.ice_hosts or [])
        self.peers: dict[str, object] = {}  # id -> RtcPeer or WebSocketResponse, each holding a slot
        self.slots = PeerSlots(cfg.max_peers, cfg.max_peers_per_tenant or max(1, cfg.max_peers // 2))
        self.preauth = PreAuthPool(cfg.max_preauth, cfg.max_preauth_per_address)
        self.trusted = trusted_proxies(cfg.trusted_proxy)  # whose X-Forwarded-For names the client
        self._ids = itertools.count(1)
        self.served = {"rtc": 0, "ws": 0, "ws_token_in_header": 0, "refused": 0}
        self.app = web.Application(client_max_size=MAX_SDP_BYTES + 4096)
        for path in PAGES:
            self.app.router.add_get(path, self.page)
        self.app.router.add_get("/api/info", self.info)
        self.app.router.add_get("/api/budget", self.budget)
        self.app.router.add_post("/api/offer", self.offer)
        self.app.router.add_get("/api/ws", self.socket)
        self.app.router.add_get("/healthz", self.health)
        self._runner: web.AppRunner | None = None
        self._budget: tuple[float, dict] | None = None  # (when asked, the budget) from the gateway

    # ---- auth ----------------------------------------------------------------------------------------------

    def token_problem(self, token: str | None) -> tuple[int, str] | None:
        """None when ``token`` may generate; else the HTTP status and what is wrong (the gateway's wording)."""
        return self.check_token(token)[1]

    def check_token(self, token: str | None) -> tuple[str | None, tuple[int, str] | None]:
        """(the token's tenant, None) when it may generate (tenant None: no tokens asked); else (None, the HTTP
        status and what is wrong)."""
        if self.auth is None:
            return None, None
        who = self.auth.principal([("authorization", f"Bearer {token}")]) if token and token.strip() else None
        if who is None:
            return None, (401, "a valid bearer token is required (Authorization: Bearer <token>)")
        if not who.may_generate:
            return None, (403, f"token of tenant {who.tenant!r} may not generate")
        return who.tenant, None

    def client_for(self, token: str | None):
        name = self.cfg.gateway_tls_name
        options = [("grpc.ssl_target_name_override", name)] if name else []

        def open_client() -> AsyncClient:
            return AsyncClient(
                self.cfg.gateway,
                token=token if self.auth is not None else None,
                tls=self.cfg.gateway_tls or None,
                root_certificates=self.cfg.gateway_ca,
                options=options,
            )

        return open_client

    def _take(self, peer_id: str, tenant: str | None) -> str | None:
        """Take a peer slot for an authenticated browser; the refusal's text when none is free."""
        refusal = self.slots.take(peer_id, tenant)
        if refusal is not None:
            self.served["refused"] += 1
        return refusal

    def _free(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)
        self.slots.free(peer_id)

    # ---- routes --------------------------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        name, kind = PAGES[request.path]
        return web.Response(
            body=(STATIC / name).read_bytes(),
            content_type=kind,
            headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"peers": len(self.slots), "preauth": len(self.preauth), "evicted": self.preauth.evictions, **self.served}
        )

    async def info(self, request: web.Request) -> web.Response:
        servers = [
            {k: v for k, v in (("urls", s.urls), ("username", s.username), ("credential", s.credential)) if v}
            for s in self.cfg.ice_servers
        ]
        return web.json_response(
            {
                "ice_servers": servers,
                "token_required": self.auth is not None,
                "max_peers": self.cfg.max_peers,
                "peers": len(self.slots),
                "peer_timeout_s": self.cfg.peer_timeout,
                "max_message_bytes": MAX_MESSAGE_BYTES,
            }
        )

    async def budget(self, request: web.Request) -> web.Response:
        """The gateway's cost budget (``GatewayStatus.cost_budget``), asked with the caller's token."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else None
        problem = self.token_problem(token)
        if problem is not None:
            return _refuse(*problem)
        now = asyncio.get_running_loop().time()
        if self._budget is None or now - self._budget[0] > BUDGET_TTL_S:
            client = self.client_for(token)()
            try:
                status = await client.status(timeout=5.0)
            except StagecastError as exc:
                return _refuse(502, f"gateway: {exc}")
            finally:
                await client.close()
            budget = status.cost_budget
            self._budget = (now, {name: getattr(budget, name) for name in BUDGET_FIELDS})
        return web.json_response(self._budget[1])

    async def offer(self, request: web.Request) -> web.Response:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        tenant, problem = self.check_token(token.strip() if scheme.lower() == "bearer" else None)
        if problem is not None:
            return _refuse(*problem)
        if request.content_length is not None and request.content_length > MAX_SDP_BYTES + 4096:
            return _refuse(413, f"sdp: over {MAX_SDP_BYTES} bytes")
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return _refuse(413, f"sdp: over {MAX_SDP_BYTES} bytes")
        except ValueError:
            return _refuse(400, 'body: not JSON (send {"sdp": ..., "type": "offer"})')
        if not isinstance(body, dict) or body.get("type") != "offer":
            return _refuse(400, 'type: must be "offer"')
        peer_id = f"rtc-{next(self._ids)}"
        if (refusal := self._take(peer_id, tenant)) is not None:
            return _refuse(503, refusal)
        peer = RtcPeer(
            lambda sink, send, fatal: Session(self.client_for(token.strip()), sink, send, codec="raw", on_fatal=fatal),
            ice_servers=self.cfg.ice_servers,
            peer_timeout=self.cfg.peer_timeout,
            connect_timeout=self.cfg.connect_timeout,
            on_closed=lambda p: self._free(peer_id),
        )
        self.peers[peer_id] = peer
        try:
            answer = await peer.answer(body.get("sdp"))
        except BadOffer as exc:
            await peer.close(f"bad offer: {exc}")
            return _refuse(400, str(exc))
        self.served["rtc"] += 1
        return web.json_response({"sdp": answer, "type": "answer", "peer": peer_id})

    async def socket(self, request: web.Request) -> web.StreamResponse:
        """A WebSocket peer.  With a token in ``Sec-WebSocket-Protocol`` it takes a peer slot at once (the config must
        follow within ``FIRST_MESSAGE_S``); without, it waits in the pre-auth pool and must send its token in its first
        message within ``PREAUTH_S``, and takes a slot only then (``SocketAuth``)."""
        auth = SocketAuth(self, f"ws-{next(self._ids)}", protocol_token(request))
        refusal = auth.admit(client_address(request.remote, request.headers.get("X-Forwarded-For"), self.trusted))
        if refusal is not None:
            return refusal
        ws = web.WebSocketResponse(
            heartbeat=self.cfg.peer_timeout / 2, max_msg_size=MAX_MESSAGE_BYTES, protocols=(WS_PROTOCOL,)
        )
        try:
            await ws.prepare(request)
            if not auth.opened(ws):  # evicted while the handshake was under way
                await ws.close(message=EVICTED)
                return ws

            def make_session(sink, send, fatal):
                return Session(lambda: self.client_for(auth.token)(), sink, send, codec="h264", on_fatal=fatal)

            why_closed = await serve_socket(ws, make_session, auth.authorize)
            logger.info("socket %s closed: %s", auth.peer_id, why_closed)
        finally:
            auth.release()
        return ws

    # ---- lifecycle -----------------------------------------------------------------------------------------

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> str:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls, reuse_port=False)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # noqa: SLF001 - the port chosen for port 0
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        return f"{'https' if tls else 'http'}://{shown}:{bound[1]}/"

    async def stop(self) -> None:
        for peer in list(self.peers.values()):
            if isinstance(peer, RtcPeer):
                await peer.close("shutting down")
            else:
                await peer.close(message=b"shutting down")
        if self._runner is not None:
            await self._runner.cleanup()


def protocol_token(request: web.Request) -> str | None:
    """The bearer token a WebSocket offers as ``bearer.<token>`` in ``Sec-WebSocket-Protocol``, else None."""
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    return next((p[len(BEARER_PROTOCOL) :] for p in offered if p.startswith(BEARER_PROTOCOL)), None)


class SocketAuth:
    """One WebSocket's way to a peer slot.  With a token from its handshake it takes the slot before the upgrade;
    without, it waits in the pre-auth pool (where a newcomer below its fair share may evict it) until its first
    message brings the token.  Either way it is closed if that message does not come in time."""

    def __init__(self, app: WebApp, peer_id: str, header_token: str | None):
        self.app = app
        self.peer_id = peer_id
        self.token = header_token  # the token its gateway client uses, once known
        self.waiting = header_token is None  # in the pre-auth pool
        self.entry = None
        self.ws: web.WebSocketResponse | None = None  # set once prepared: an eviction closes it
        self.evicted = False
        self.timer: asyncio.TimerHandle | None = None

    def _evict(self) -> None:  # a newcomer below its fair share took this socket's place (web.slots)
        self.evicted = True
        if self.ws is not None:
            asyncio.get_running_loop().create_task(self.ws.close(message=EVICTED))

    def admit(self, address: str | None) -> web.Response | None:
        """Before the upgrade: a place in the pre-auth pool, or a peer slot for the handshake's token; else the
        refusal to answer."""
        if self.waiting:
            self.entry = self.app.preauth.enter(address, self._evict)
            if isinstance(self.entry, str):
                self.app.served["refused"] += 1
                return _refuse(503, self.entry)
            return None
        tenant, problem = self.app.check_token(self.token)
        if problem is not None:
            return _refuse(*problem)
        if (refusal := self.app._take(self.peer_id, tenant)) is not None:
            return _refuse(503, refusal)
        return None

    def opened(self, ws: web.WebSocketResponse) -> bool:
        """The upgrade is done: False when the socket was evicted meanwhile (close it); else its first message's
        timer runs."""
        self.ws = ws
        if self.evicted:
            return False
        if self.waiting:
            why = f"no token within {PREAUTH_S:g} s".encode()
        else:
            self._serve(ws)
            self.app.served["ws_token_in_header"] += 1  # never in the pre-auth pool
            why = f"no config within {FIRST_MESSAGE_S:g} s".encode()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(
            PREAUTH_S if self.waiting else FIRST_MESSAGE_S, lambda: loop.create_task(ws.close(message=why))
        )
        return True

    def _serve(self, ws: web.WebSocketResponse) -> None:
        self.app.peers[self.peer_id] = ws
        self.app.served["ws"] += 1

    def authorize(self, token: str | None) -> tuple[str, str] | None:
        """At the first message (``web.fallback``): None when the socket may stream, else the (code, text) it is
        refused with."""
        if self.timer is not None:
            self.timer.cancel()
        if not self.waiting:
            return None  # authenticated by its header; a token in the config is not needed
        tenant, problem = self.app.check_token(token)
        if problem is not None:
            return ("UNAUTHENTICATED" if problem[0] == 401 else "PERMISSION_DENIED"), problem[1]
        self.app.preauth.leave(self.entry)
        self.waiting = False
        if (refusal := self.app._take(self.peer_id, tenant)) is not None:
            return "RESOURCE_EXHAUSTED", refusal
        assert self.ws is not None
        self._serve(self.ws)
        self.token = token
        return None

    def release(self) -> None:
        """The socket closed: its timer, its place in the pool or its peer slot go back."""
        if self.timer is not None:
            self.timer.cancel()
        if self.waiting:
            self.app.preauth.leave(self.entry)
        self.app._free(self.peer_id)
