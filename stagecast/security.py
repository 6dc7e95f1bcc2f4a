"""Credentials shared by every stagecast service: mTLS inside the deployment, TLS and bearer tokens at the gateway.

Inside a deployment every gRPC connection is mutual TLS with one deployment CA.  A certificate names its holder's
**role** (its common name: ``coordinator``, ``stage``, ``gateway``, ``vae-stage`` or ``operator``) and carries the
DNS name ``<role>.stagecast.internal``; a client checks that the server it reached holds the role it meant to call
(``grpc.ssl_target_name_override``), so certificates do not depend on addresses, and a server lets each role call only
the methods that role needs (``RoleGuard``).  A folder of credentials is laid out as a Kubernetes TLS Secret
(cert-manager writes the same keys)::

    DIR/ca.crt  DIR/tls.crt  DIR/tls.key

Usage::

    write_deployment("/tmp/creds", ["coordinator", "stage", "gateway", "operator"])  # throwaway CA + one cert per role
    mtls = MTLS.load("/tmp/creds/stage")                     # role "stage"
    server, health, port = make_server(0, services, credentials=mtls.server_credentials(),
                                       interceptors=[RoleGuard(COORDINATOR_ROLES)])
    channel = connect("10.0.0.1:50050", mtls, peer="coordinator")   # insecure_channel when mtls is None

The public API: ``TokenAuth`` reads bearer tokens from a file (a mounted Kubernetes Secret; re-read when it
changes), one token per line::

    # token                              tenant   [role: user (default) | admin | status]
    4c1f0b3a9d8e2f7a6b5c4d3e2f1a0b9c     alice
    9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b     ops      admin

Each token is a tenant.  ``user`` tokens generate and see their own streams; ``admin`` tokens also see every stream;
``status`` tokens (dashboards) see every stream but cannot generate (PERMISSION_DENIED).  A call without a token or
with an unknown one gets UNAUTHENTICATED.  The health service stays open, for load balancers.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

INTERNAL_DOMAIN = "stagecast.internal"
ROLES = ("coordinator", "stage", "gateway", "vae-stage", "operator")
MTLS_ENV = "STAGECAST_MTLS"  # default of every service's --mtls
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
MAX_CREDENTIAL_BYTES = 64 * 1024
MAX_TOKENS = 10_000


def server_name(role: str) -> str:
    return f"{role}.{INTERNAL_DOMAIN}"


# ---- certificates ------------------------------------------------------------------------------------------


def _x509():
    # cryptography is imported lazily: only processes that make certificates need it.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _pem_key(key) -> bytes:
    _, _, serialization, _, _, _ = _x509()
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(name: str = "stagecast deployment CA", days: int = 30) -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, private key PEM)."""
    x509, hashes, serialization, ec, _, NameOID = _x509()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(ca_cert: bytes, ca_key: bytes, role: str, hosts: Sequence[str] = (), days: int = 30) -> tuple[bytes, bytes]:
    """A certificate for ``role`` signed by the CA: common name ``role``, DNS ``<role>.stagecast.internal`` plus
    ``hosts`` (names or IP addresses), usable as server and client.  Returns (certificate PEM, key PEM)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    x509, hashes, serialization, ec, EKU, NameOID = _x509()
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list = [x509.DNSName(server_name(role))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_deployment(folder: str | os.PathLike, roles: Iterable[str] = ROLES, hosts: Sequence[str] = ()) -> Path:
    """A throwaway deployment CA and one certificate per role under ``folder`` (created private, 0700):
    ``folder/ca.crt`` and ``folder/<role>/{ca.crt,tls.crt,tls.key}``.  The CA's key is not kept."""
    root = Path(folder)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    ca_cert, ca_key = make_ca()
    (root / "ca.crt").write_bytes(ca_cert)
    for role in roles:
        cert, key = issue(ca_cert, ca_key, role, hosts)
        sub = root / role
        sub.mkdir(mode=0o700, exist_ok=True)
        (sub / "ca.crt").write_bytes(ca_cert)
        (sub / "tls.crt").write_bytes(cert)
        _write_private(sub / "tls.key", key)
    return root


def _read(path: Path, what: str) -> bytes:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    if size > MAX_CREDENTIAL_BYTES:
        raise ValueError(f"{what}: {path} is {size} bytes, more than {MAX_CREDENTIAL_BYTES}")
    return path.read_bytes()


def role_of_certificate(cert_pem: bytes) -> str:
    x509, _, _, _, _, NameOID = _x509()
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


@dataclass(frozen=True)
class MTLS:
    """This process's deployment credentials: the CA, its certificate and key, and the role they name."""

    ca: bytes
    cert: bytes
    key: bytes
    role: str
    folder: str = ""

    @classmethod
    def load(cls, folder: str | os.PathLike) -> MTLS:
        root = Path(folder)
        if not root.is_dir():
            raise FileNotFoundError(f"--mtls: {root} is not a folder (expected ca.crt, tls.crt, tls.key)")
        ca = _read(root / "ca.crt", "--mtls CA")
        cert = _read(root / "tls.crt", "--mtls certificate")
        key = _read(root / "tls.key", "--mtls key")
        try:
            role = role_of_certificate(cert)
        except ValueError as exc:
            raise ValueError(f"--mtls certificate: {root / 'tls.crt'} is not a PEM certificate ({exc})") from None
        if role not in ROLES:
            raise ValueError(f"--mtls certificate: common name {role!r} is not a stagecast role {ROLES}")
        return cls(ca, cert, key, role, str(root))

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS that refuses any client without a certificate of the deployment CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def mtls_from_flags(folder: str | None, insecure: bool, what: str) -> MTLS | None:
    """The ``--mtls DIR`` / ``--insecure-internal`` pair every service takes (``DIR`` defaults to $STAGECAST_MTLS)."""
    folder = folder or os.environ.get(MTLS_ENV) or None
    if insecure:
        if folder:
            raise ValueError("--mtls and --insecure-internal exclude each other")
        logger.warning("%s: internal gRPC without mTLS (--insecure-internal): anyone who reaches it owns it", what)
        return None
    if not folder:
        raise ValueError(
            f"{what} needs the deployment's mTLS credentials: --mtls DIR (ca.crt, tls.crt, tls.key; or ${MTLS_ENV}),"
            " or --insecure-internal"
        )
    return MTLS.load(folder)


def add_mtls_flags(parser) -> None:
    parser.add_argument(
        "--mtls",
        default=None,
        help=f"folder with the deployment CA and this service's certificate: ca.crt, tls.crt, tls.key"
        f" (default: ${MTLS_ENV})",
    )
    parser.add_argument(
        "--insecure-internal", action="store_true", help="internal gRPC without mTLS (development only)"
    )


def connect(target: str, mtls: MTLS | None, peer: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to an internal service whose certificate must name the role ``peer`` (plaintext without mTLS)."""
    if mtls is None:
        return grpc.insecure_channel(target, options=list(options))
    opts = [*options, ("grpc.ssl_target_name_override", server_name(peer))]
    return grpc.secure_channel(target, mtls.channel_credentials(), options=opts)


# ---- server interceptors ------------------------------------------------------------------------------------


def _guarded(handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], None]) -> grpc.RpcMethodHandler:
    """The same handler, with ``check(context)`` (which aborts to refuse) before the method runs."""

    def unary(behavior):
        def run(request_or_iterator, context):
            check(context)
            return behavior(request_or_iterator, context)

        return run

    def streaming(behavior):
        def run(request_or_iterator, context):
            check(context)
            yield from behavior(request_or_iterator, context)

        return run

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)


def peer_role(context: grpc.ServicerContext) -> str:
    """The role (certificate common name) of an mTLS peer; "" on a plaintext connection."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else ""


class RoleGuard(grpc.ServerInterceptor):
    """Let each role call only the methods it needs.  ``rules`` maps a full method name (``/pkg.Service/Method``)
    or a service prefix (``/pkg.Service/``) to the roles allowed; ``operator`` may call everything, and every
    authenticated role may use health and reflection.  Anything unlisted is refused (PERMISSION_DENIED)."""

    def __init__(self, rules: Mapping[str, Iterable[str]]):
        self.rules = {name: frozenset(roles) | {"operator"} for name, roles in rules.items()}

    def allowed(self, method: str) -> frozenset[str]:
        if method.startswith(HEALTH_PREFIX) or method.startswith(REFLECTION_PREFIX):
            return frozenset(ROLES)
        if method in self.rules:
            return self.rules[method]
        service = method[: method.rfind("/") + 1]
        return self.rules.get(service, frozenset({"operator"}))

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        allowed = self.allowed(method)

        def check(context):
            role = peer_role(context)
            if not role:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a client certificate of the deployment")
            if role not in allowed:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} may not be called by role {role!r} ({sorted(allowed)})",
                )

        return _guarded(handler, check)


# ---- bearer tokens ----------------------------------------------------------------------------------------------

TOKEN_ROLES = ("user", "admin", "status")


@dataclass(frozen=True)
class Principal:
    """Who is calling the public API: a tenant and its role (``anonymous`` when the gateway runs without tokens)."""

    tenant: str
    role: str

    @property
    def sees_all(self) -> bool:
        return self.role in ("admin", "status", "anonymous")

    @property
    def may_generate(self) -> bool:
        return self.role in ("user", "admin", "anonymous")


ANONYMOUS = Principal("", "anonymous")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, source: str = "tokens") -> dict[bytes, Principal]:
    """``token tenant [role]`` lines ('#' comments) -> {sha256(token): Principal}; a bad line names its number."""
    table: dict[bytes, Principal] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"{source} line {number}: expected 'token tenant [role]', got {len(parts)} fields")
        token, tenant = parts[0], parts[1]
        role = parts[2] if len(parts) == 3 else "user"
        if len(token) < 16:
            raise ValueError(f"{source} line {number}: a token must have at least 16 characters")
        if role not in TOKEN_ROLES:
            raise ValueError(f"{source} line {number}: role must be one of {TOKEN_ROLES}, got {role!r}")
        key = _digest(token)
        if key in table:
            raise ValueError(f"{source} line {number}: the same token appears twice")
        table[key] = Principal(tenant, role)
        if len(table) > MAX_TOKENS:
            raise ValueError(f"{source}: more than {MAX_TOKENS} tokens")
    if not table:
        raise ValueError(f"{source}: no tokens")
    return table


class TokenAuth(grpc.ServerInterceptor):
    """Bearer tokens (``authorization: Bearer <token>``) from a file, re-read when it changes (a Kubernetes
    Secret mounted as a file is updated in place).  ``generate_methods`` need a role that may generate."""

    def __init__(self, path: str | os.PathLike, generate_methods: Iterable[str] = (), reload_s: float = 2.0):
        self.path = Path(path)
        self.generate_methods = frozenset(generate_methods)
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._table = self._load()

    def _load(self) -> dict[bytes, Principal]:
        text = _read(self.path, "--tokens").decode("utf-8", errors="replace")
        stat = self.path.stat()
        self._stamp = (stat.st_mtime_ns, stat.st_size)
        return parse_tokens(text, f"--tokens {self.path}")

    def _current(self) -> dict[bytes, Principal]:
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= self.reload_s:
                self._checked = now
                try:
                    stat = self.path.stat()
                    if (stat.st_mtime_ns, stat.st_size) != self._stamp:
                        self._table = self._load()
                        logger.info("reloaded %d tokens from %s", len(self._table), self.path)
                except (OSError, ValueError) as exc:
                    logger.error("keeping the previous tokens: %s", exc)
            return self._table

    def principal(self, metadata: Iterable[tuple[str, object]] | None) -> Principal | None:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    return None
                found = self._current().get(_digest(token.strip()))
                return found
        return None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        needs_generate = method in self.generate_methods

        def check(context):
            who = self.principal(context.invocation_metadata())
            if who is None:
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required (authorization: Bearer <token>)"
                )
            if needs_generate and not who.may_generate:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"token of tenant {who.tenant!r} may not generate")

        return _guarded(handler, check)


def principal_of(auth: TokenAuth | None, context: grpc.ServicerContext) -> Principal:
    """The caller of a public method (after ``TokenAuth`` let it in); everyone is ``ANONYMOUS`` without tokens."""
    if auth is None:
        return ANONYMOUS
    who = auth.principal(context.invocation_metadata())
    if who is None:  # the interceptor refuses these; never serve one by mistake
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
    return who


def server_tls(cert_file: str | None, key_file: str | None) -> grpc.ServerCredentials | None:
    """Public TLS (no client certificates) from ``--tls-cert``/``--tls-key``; None when neither is given."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("--tls-cert and --tls-key go together")
    cert = _read(Path(cert_file), "--tls-cert")
    key = _read(Path(key_file), "--tls-key")
    return grpc.ssl_server_credentials([(key, cert)])


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
