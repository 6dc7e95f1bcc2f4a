"""Which client a gateway call belongs to, for its quotas and its fair share of the pending pool.

Usage (``gateway.edge.handlers`` asks for every call; ``gateway.service.Gateway`` holds one)::

    identity = ClientIdentity(auth, opts.trusted_proxy)   # --trusted-proxy ADDR[,ADDR ...], repeatable
    who = identity.of(context)      # "tenant 'alice'" with --tokens, else "address 10.0.0.7"
    identity.via_proxy(context)     # True: a trusted proxy (the door) forwarded this call

The rule is ``stagecast.client_identity.client_key`` (the web edge uses the same): the tenant, else the peer's
address, or behind a trusted proxy (``--trusted-proxy``, the fleet's HAProxy door) the ``x-forwarded-for`` address
it appended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagecast.client_identity import client_key, peer_is_trusted, trusted_proxies

if TYPE_CHECKING:
    import grpc

    from stagecast.client_identity import Network
    from stagecast.security import TokenAuth

FORWARDED_FOR = "x-forwarded-for"


class ClientIdentity:
    def __init__(self, auth: TokenAuth | None, trusted: list[str] | tuple | None = None):
        self.auth = auth
        self.trusted: tuple[Network, ...] = trusted_proxies(trusted)

    def of(self, context: grpc.ServicerContext) -> str:
        tenant = None
        if self.auth is not None:
            from stagecast.security import principal_of

            tenant = principal_of(self.auth, context).tenant
        return client_key(tenant, context.peer(), self._forwarded(context), self.trusted)

    def via_proxy(self, context: grpc.ServicerContext) -> bool:
        """Whether a proxy (the fleet's door) sent this call on for a client: it carries ``x-forwarded-for``, from a
        trusted proxy where ``--trusted-proxy`` names any.  Without one, any peer's header counts: only for the
        agent's cap (the streams the door holds here; a fleet's gateways are reachable by the door alone), never
        for who the client is."""
        if not _forwarded_for(context):
            return False
        return not self.trusted or peer_is_trusted(context.peer(), self.trusted)

    def _forwarded(self, context: grpc.ServicerContext) -> str | None:
        return _forwarded_for(context) if self.trusted else None


def _forwarded_for(context: grpc.ServicerContext) -> str:
    return ", ".join(
        str(v) for k, v in (context.invocation_metadata() or ()) if k == FORWARDED_FOR and isinstance(v, str)
    )
