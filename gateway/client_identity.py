"""Which client a gateway call belongs to, for its quotas and its fair share of the pending pool.

Usage (``gateway.handlers`` asks for every call; ``gateway.service.Gateway`` holds one)::

    identity = ClientIdentity(auth, opts.trusted_proxy)   # --trusted-proxy ADDR[,ADDR ...], repeatable
    who = identity.of(context)      # "tenant 'alice'" with --tokens, else "address 10.0.0.7"

The rule is ``stagecast.client_identity.client_key`` (the web edge uses the same): the tenant, else the peer's
address, or behind a trusted proxy (``--trusted-proxy``, the fleet's HAProxy door) the ``x-forwarded-for`` address
it appended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagecast.client_identity import client_key, trusted_proxies

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
        forwarded = None
        if self.trusted:
            forwarded = ", ".join(
                str(v) for k, v in (context.invocation_metadata() or ()) if k == FORWARDED_FOR and isinstance(v, str)
            )
        return client_key(tenant, context.peer(), forwarded, self.trusted)
