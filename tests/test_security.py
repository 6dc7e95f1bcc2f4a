"""Authenticated everywhere, against the real services on loopback: mTLS between services, a rendezvous only
stages can use, TLS and bearer tokens at the gateway, one tenant's streams hidden from and out of reach of another,
and no socket of ``stagecast up --host 127.0.0.1`` listening outside loopback."""

from __future__ import annotations

import signal
import socket
import tempfile
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import stagecast
from coordinator.rendezvous import RendezvousServicer
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.process import Launcher
from stage_service.rendezvous import GrpcStore
from stagecast import errors
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.internal.v1 import rendezvous_pb2 as rpb
from stagecast.internal.v1 import rendezvous_pb2_grpc as rpb_grpc
from stagecast.internal.v1 import vae_pb2 as vpb
from stagecast.security import MTLS, connect, issue, make_ca, parse_tokens, server_name, write_deployment
from stagecast.v1 import stream_pb2 as pb
from tests.listening import listening_sockets, process_tree

TIMEOUT = 120
TOKENS = {
    "alice": "alice-token-0123456789abcdef",
    "bob": "bob-token-0123456789abcdef",
    "ops": "ops-token-0123456789abcdef",
    "dash": "dash-token-0123456789abcdef",
    "carol": "carol-token-0123456789abcdef",  # revoked by a test
}


@pytest.fixture(scope="module")
def deployment(system_session, tmp_path_factory):
    """A VAE stage and a gateway (public TLS + tokens) of this module's own on the session's shared system
    (coordinator and 2 stages), all with mTLS on loopback."""
    s = system_session
    tmp = tmp_path_factory.mktemp("auth")
    tokens = tmp / "tokens"
    tokens.write_text(
        "# token tenant [role]\n"
        f"{TOKENS['alice']} alice\n{TOKENS['bob']} bob user\n{TOKENS['ops']} ops admin\n{TOKENS['dash']} dash status\n"
        f"{TOKENS['carol']} carol\n"
    )
    public_ca, public_key = make_ca("public CA of the test")
    cert, key = issue(public_ca, public_key, "gateway", hosts=["127.0.0.1", "localhost"])
    (tmp / "gw.crt").write_bytes(cert)
    (tmp / "gw.key").write_bytes(key)
    (tmp / "public-ca.crt").write_bytes(public_ca)
    vae_args = ["vae-stage", "--checkpoint", str(s.root), "--index", "0", "--num-slices", "1", "--port", "0"]
    gateway_args = ["gateway", "--coordinator", s.coordinator, "--checkpoint", str(s.root), "--port", "0"]
    gateway_args += ["--tokens", str(tokens), "--tls-cert", str(tmp / "gw.crt"), "--tls-key", str(tmp / "gw.key")]
    gateway_args += ["--config-timeout", "60"]  # calls held without a config stay held for as long as a test needs
    with s.spawned("security-vae", vae_args) as vae, s.spawned("security-gateway", gateway_args) as gateway:
        yield {
            "system": s,
            "launcher": s.launcher,
            "coordinator": s.coordinator,
            "stages": [child.info["address"] for name, child in s.children.items() if name.startswith("stage-")],
            "vae": vae.info["address"],
            "gateway": gateway.info["address"],
            "public_ca": tmp / "public-ca.crt",
            "tmp": tmp,
        }
    s.assert_idle()


def _raw_call(channel: grpc.Channel, service, method, timeout: float = 10.0):
    """Call any method with an empty request (raw bytes), whatever its shape; returns the status code."""
    path = f"/{service.full_name}/{method.name}"
    ident = lambda b: b  # noqa: E731
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path, ident, ident)(iter([]), timeout=timeout))
        elif method.client_streaming:
            channel.stream_unary(path, ident, ident)(iter([]), timeout=timeout)
        elif method.server_streaming:
            list(channel.unary_stream(path, ident, ident)(b"", timeout=timeout))
        else:
            channel.unary_unary(path, ident, ident)(b"", timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _internal_services(deployment):
    """(address, role it serves as, service descriptors) of every internal gRPC server of the deployment."""
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]
    coordinator = [
        ipb.DESCRIPTOR.services_by_name["CoordinatorService"],
        rpb.DESCRIPTOR.services_by_name["RendezvousService"],
    ]
    stage = [ipb.DESCRIPTOR.services_by_name["StageService"]]
    vae = [vpb.DESCRIPTOR.services_by_name["VAEStageService"]]
    yield deployment["coordinator"], "coordinator", [*coordinator, health]
    for address in deployment["stages"]:
        yield address, "stage", [*stage, health]
    yield deployment["vae"], "vae-stage", [*vae, health]


@pytest.mark.multiprocess
def test_every_internal_rpc_without_a_client_certificate_of_the_deployment_is_refused(deployment):
    launcher = deployment["launcher"]
    ca = launcher.mtls().ca
    # A stranger: a certificate of the right role from another CA.
    stranger_dir = write_deployment(deployment["tmp"] / "stranger", ["operator"])
    stranger = MTLS.load(stranger_dir / "operator")
    tried = 0
    for address, role, services in _internal_services(deployment):
        override = [("grpc.ssl_target_name_override", server_name(role))]
        channels = {
            "plaintext": grpc.insecure_channel(address),
            "TLS without a client certificate": grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=ca), options=override
            ),
            "a certificate of another CA": grpc.secure_channel(
                address,
                grpc.ssl_channel_credentials(ca, stranger.key, stranger.cert),
                options=override,
            ),
        }
        for what, channel in channels.items():
            with channel:
                for service in services:
                    for method in service.methods:
                        code = _raw_call(channel, service, method)
                        assert code == grpc.StatusCode.UNAVAILABLE, f"{address} {service.name}/{method.name}: {what}"
                        tried += 1
    assert tried >= 3 * (7 + 8 + 2 * 5 + 2 + 4 * 2)  # every method of every internal server, three ways
    # The operator's certificate of this deployment does get through (the refusals above are not a dead server).
    with launcher.channel(deployment["coordinator"], "coordinator") as ch:
        assert ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10).ready


@pytest.mark.multiprocess
def test_each_role_may_call_only_what_it_needs(deployment):
    launcher = deployment["launcher"]
    coordinator, stage0 = deployment["coordinator"], deployment["stages"][0]
    denied = grpc.StatusCode.PERMISSION_DENIED
    # A stage's certificate cannot open, stop or re-prompt streams, nor drive another stage.
    stage_creds = launcher.mtls("stage")
    gateway_creds = launcher.mtls("gateway")
    with connect(coordinator, stage_creds, "coordinator") as ch:
        stub = ipb_grpc.CoordinatorServiceStub(ch)
        for call in (
            lambda: list(stub.OpenStream(ipb.OpenStreamRequest(), timeout=10)),
            lambda: stub.StopStream(ipb.StopRequest(stream_id=1), timeout=10),
            lambda: stub.UpdatePrompt(ipb.PromptUpdate(stream_id=1), timeout=10),
            lambda: stub.GetPlan(ipb.PlanRequest(), timeout=10),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == denied
    with connect(stage0, stage_creds, "stage") as ch:
        with pytest.raises(grpc.RpcError) as err:
            ipb_grpc.StageServiceStub(ch).Reset(ipb.ResetRequest(reason="a peer"), timeout=10)
        assert err.value.code() == denied
    # The gateway's certificate cannot register as a stage, use the rendezvous store or make a stage form anywhere.
    with connect(coordinator, gateway_creds, "coordinator") as ch:
        with pytest.raises(grpc.RpcError) as err:
            ipb_grpc.CoordinatorServiceStub(ch).Register(ipb.RegisterRequest(index=0, address="10.9.9.9:1"), timeout=10)
        assert err.value.code() == denied
        with pytest.raises(grpc.RpcError) as err:
            rpb_grpc.RendezvousServiceStub(ch).Set(rpb.StoreSet(key="stagecast/gen1/0", value=b"x"), timeout=10)
        assert err.value.code() == denied
        assert ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10).ready  # what it needs works
    with connect(stage0, gateway_creds, "stage") as ch:
        with pytest.raises(grpc.RpcError) as err:
            ipb_grpc.StageServiceStub(ch).Form(ipb.Rendezvous(generation=99, world_size=2), timeout=10)
        assert err.value.code() == denied
    # A client that expected the coordinator but reached a stage notices (the stage's certificate names its role).
    with connect(stage0, gateway_creds, "coordinator") as ch:
        with pytest.raises(grpc.RpcError) as err:
            ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _client(deployment, token=None, **kw):
    return stagecast.Client(deployment["gateway"], token=token, root_certificates=deployment["public_ca"], **kw)


@pytest.mark.multiprocess
def test_the_public_api_without_a_token_or_with_a_wrong_one_is_unauthenticated(deployment):
    for token in (None, "wrong-token-0123456789abcdef", TOKENS["alice"] + "x"):
        with _client(deployment, token) as client:
            with pytest.raises(errors.UnauthenticatedError):
                client.status()
            with pytest.raises(errors.UnauthenticatedError):
                next(iter(client.watch_status(timeout=10)))
            with pytest.raises(errors.UnauthenticatedError):
                client.generate(prompt="a fox", seconds=0.5, codec="raw").collect()
    # A status token may watch but not generate.
    with _client(deployment, TOKENS["dash"]) as client:
        client.status()
        with pytest.raises(errors.PermissionDeniedError):
            client.generate(prompt="a fox", seconds=0.5, codec="raw").collect()
    # Health stays open to load balancers; reflection does not.
    creds = grpc.ssl_channel_credentials(root_certificates=deployment["public_ca"].read_bytes())
    with grpc.secure_channel(deployment["gateway"], creds) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        reflection = "grpc.reflection.v1alpha.ServerReflection"
        path = f"/{reflection}/ServerReflectionInfo"
        with pytest.raises(grpc.RpcError) as err:
            list(ch.stream_stream(path, lambda b: b, lambda b: b)(iter([b""]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The public port speaks only TLS.
    with grpc.insecure_channel(deployment["gateway"]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.multiprocess
def test_one_tenant_cannot_see_stop_or_reprompt_another_tenants_stream(deployment):
    public = pb.DESCRIPTOR.services_by_name["StreamService"]
    # No public request names a stream: stop and prompt updates travel only on the stream's own Generate call.
    for method in public.methods:
        fields = {f.name for f in method.input_type.fields}
        assert not any("stream" in name for name in fields), f"{method.name} takes a stream id: {fields}"
    with _client(deployment, TOKENS["alice"]) as alice, _client(deployment, TOKENS["bob"]) as bob:
        with _client(deployment, TOKENS["ops"]) as ops:
            gen = alice.generate(prompt="a red fox", codec="raw")  # unbounded: runs until alice stops it
            frames = iter(gen)
            next(frames)
            mine = alice.status()
            assert [s.stream_id for s in mine.streams] == [gen.info.stream_id] and mine.active_streams == 1
            pipeline_id = mine.streams[0].pipeline_stream_id
            theirs = bob.status()
            assert list(theirs.streams) == [] and theirs.active_streams == 0
            assert theirs.coordinator == "" and theirs.streams_started == 0  # nothing of the deployment leaks
            assert list(next(iter(bob.watch_status(timeout=10))).streams) == []
            everything = ops.status()
            assert [s.stream_id for s in everything.streams] == [gen.info.stream_id]
            assert everything.coordinator == deployment["coordinator"]
            # Knowing the pipeline id does not help: the coordinator refuses anyone without the gateway's certificate.
            with grpc.insecure_channel(deployment["coordinator"]) as ch:
                stub = ipb_grpc.CoordinatorServiceStub(ch)
                for call in (
                    lambda: stub.StopStream(ipb.StopRequest(stream_id=pipeline_id), timeout=10),
                    lambda: stub.UpdatePrompt(ipb.PromptUpdate(stream_id=pipeline_id), timeout=10),
                ):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # Alice's stream went on untouched; her own prompt update and stop reach it.
            for _ in range(4):
                next(frames)
            gen.update_prompt("a red fox sleeping")
            gen.stop()
            for _ in frames:
                pass
            assert gen.end is not None and gen.end.reason == "stopped"


HELD_CALLS = 140
PENDING_QUOTA = 32  # the gateway's default --max-pending-per-client


@pytest.mark.multiprocess
def test_one_tenant_holding_calls_without_a_config_does_not_lock_another_tenant_out(deployment):
    """140 Generate calls of one tenant that never send a config: it holds its quota of them and the rest are refused
    naming the quota; another tenant's streams start, 20 of 20, while they are held."""
    import threading

    release = threading.Event()

    def no_config():  # a request stream that sends nothing until the test is over
        release.wait()
        yield from ()

    done = threading.Condition()
    codes: list = []

    def finish(call) -> None:
        code = call.code()  # blocks until the call ends
        with done:
            codes.append((code, call.details()))
            done.notify_all()

    with _client(deployment, TOKENS["alice"]) as alice, _client(deployment, TOKENS["ops"]) as ops:
        calls = [alice._stub.Generate(no_config(), timeout=TIMEOUT) for _ in range(HELD_CALLS)]
        waiters = [threading.Thread(target=finish, args=(call,)) for call in calls]
        try:
            for waiter in waiters:
                waiter.start()
            with done:
                assert done.wait_for(lambda: len(codes) == HELD_CALLS - PENDING_QUOTA, timeout=TIMEOUT)
            ops.wait_for_status(lambda s: s.waiting_calls == PENDING_QUOTA, timeout=TIMEOUT)
            assert {code for code, _ in codes} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert all("quota" in d and "'alice'" in d and "--max-pending-per-client" in d for _, d in codes)
            started = 0
            with _client(deployment, TOKENS["bob"]) as bob:
                statuses = iter(bob.watch_status(timeout=TIMEOUT))
                for i in range(20):
                    gen = bob.generate(prompt="a red fox", codec="jpeg", seed=i)
                    gen.wait_started()
                    started += 1
                    gen.cancel()
                    while next(statuses).active_streams:  # gone before the next one starts
                        pass
            assert started == 20
            assert ops.status().waiting_calls == PENDING_QUOTA  # alice's calls were held all along
        finally:
            for call in calls:
                call.cancel()
            release.set()
            for waiter in waiters:
                waiter.join(TIMEOUT)
    assert len(codes) == HELD_CALLS


@pytest.mark.multiprocess
def test_revoking_a_token_ends_the_streams_it_opened_with_unauthenticated(deployment):
    import time

    tokens = deployment["tmp"] / "tokens"
    with _client(deployment, TOKENS["carol"]) as carol, _client(deployment, TOKENS["alice"]) as alice:
        # Unbounded: only the revocation ends it; unpaced, so that the paced one beside it is never over capacity.
        revoked = carol.generate(prompt="a red fox", codec="jpeg", pace=False)
        kept = alice.generate(prompt="a blue bird", codec="jpeg")
        frames = iter(revoked)
        next(frames)
        next(iter(kept))
        lines = [line for line in tokens.read_text().splitlines() if "carol" not in line]
        tokens.write_text("\n".join(lines) + "\n")
        t0 = time.monotonic()
        with pytest.raises(errors.UnauthenticatedError, match="token revoked.*'carol'"):
            for _ in frames:
                pass
        print(f"the revoked token's stream ended {time.monotonic() - t0:.2f} s after the tokens file changed")
        next(iter(kept))  # another tenant's stream goes on
        kept.cancel()
        with pytest.raises(errors.UnauthenticatedError):  # and the token opens nothing more
            carol.generate(prompt="a red fox", seconds=0.5, codec="jpeg").collect()


@pytest.mark.multiprocess
def test_the_live_page_reaches_a_tls_gateway_with_the_browsers_own_token(deployment):
    """``stagecast web`` in front of the TLS + tokens gateway: a browser's token is checked at the web edge and
    carried to the gateway; no token is refused before any WebRTC work."""
    import asyncio

    from web.rtc import use_ice_hosts
    from web.viewer import OfferRefused, RtcViewer

    use_ice_hosts(["127.0.0.1"])
    tokens = deployment["tmp"] / "tokens"
    args = ["web", "--gateway", deployment["gateway"], "--gateway-ca", str(deployment["public_ca"])]
    args += ["--tokens", str(tokens), "--port", "0"]

    async def scenario(url):
        with pytest.raises(OfferRefused) as refused:
            await RtcViewer(url).connect()
        async with RtcViewer(url, token=TOKENS["alice"]) as viewer:
            viewer.send({"type": "config", "prompt": "a red fox", "seconds": 0.5})
            return refused.value, await viewer.wait_for("end", timeout=TIMEOUT)

    with deployment["system"].spawned("security-web", args) as web:
        refused, end = asyncio.run(scenario(web.info["url"]))
    assert refused.status == 401
    # The gateway wants TLS and a token for every call: the stream ran on alice's token, over TLS.
    assert end == {"type": "end", "reason": "completed", "frames": 8}


@pytest.mark.unit
def test_the_rendezvous_store_implements_what_torch_distributed_asks():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    rpb_grpc.add_RendezvousServiceServicer_to_server(RendezvousServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            store = GrpcStore(ch, timeout_s=2)
            store.set("stagecast/gen1/a", "1")
            assert store.get("stagecast/gen1/a") == b"1"
            assert store.add("stagecast/gen1/n", 3) == 3 and store.add("stagecast/gen1/n", 2) == 5
            assert store.compare_set("stagecast/gen1/c", "", "x") == b"x"
            assert store.compare_set("stagecast/gen1/c", "y", "z") == b"x"
            assert store.compare_set("stagecast/gen1/c", "x", "z") == b"z"
            assert store.check(["stagecast/gen1/a", "stagecast/gen1/c"]) and not store.check(["nope"])
            assert store.num_keys() == 3 and store.delete_key("stagecast/gen1/a") and not store.delete_key("nope")
            with pytest.raises(TimeoutError):
                store.get("never")
            # A later generation's first write drops the earlier generations' keys.
            store.set("stagecast/gen2/a", "2")
            assert store.num_keys() == 1
            with pytest.raises(RuntimeError, match="value"):
                store.set("stagecast/gen2/big", b"x" * (1024 * 1024 + 1))
    finally:
        server.stop(0)


@pytest.mark.unit
def test_token_files_name_the_bad_line():
    with pytest.raises(ValueError, match="line 2: a token must have at least 16"):
        parse_tokens("good-token-0123456789 alice\nshort bob\n")
    with pytest.raises(ValueError, match="line 1: role must be one of"):
        parse_tokens("good-token-0123456789 alice root\n")
    with pytest.raises(ValueError, match="no tokens"):
        parse_tokens("# nothing\n")
    table = parse_tokens("good-token-0123456789 alice\nother-token-0123456789 ops admin  # comment\n")
    assert sorted((p.tenant, p.role) for p in table.values()) == [("alice", "user"), ("ops", "admin")]


@pytest.mark.unit
def test_services_refuse_to_start_without_credentials_or_tokens(tmp_path, monkeypatch):
    from tests.cli_run import run_cli as run

    monkeypatch.delenv("STAGECAST_MTLS", raising=False)

    out = run("coordinator", "--stages", "1", "--port", "0")
    assert out.returncode == 2 and "--mtls DIR" in out.stderr
    creds = write_deployment(tmp_path / "creds", ["gateway"])
    out = run("gateway", "--coordinator", "127.0.0.1:1", "--checkpoint", str(tmp_path), "--host", "0.0.0.0")
    assert out.returncode == 2 and "--tokens" in out.stderr
    out = run("coordinator", "--stages", "1", "--port", "0", "--mtls", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and "nowhere" in out.stderr
    assert (creds / "gateway" / "tls.key").stat().st_mode & 0o077 == 0  # private keys are private


@pytest.mark.multiprocess
def test_no_socket_of_stagecast_up_listens_outside_loopback():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        metrics = _free_port_block(5)
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--host", "127.0.0.1", "--port", "0"]
        args += ["--gateway-port", "0", "--metrics-port", str(metrics), "--credentials", launcher.credentials]
        up = launcher.spawn("up", [*args, "--web-port", "0"])  # the live page's sockets are checked too
        with stagecast.Client(up.info["gateway"]) as client:  # the data plane has formed and carried a clip
            assert len(client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()) == 8
        tree = process_tree(up.pid)
        assert len(tree) >= 6  # up, coordinator, 2 stages, gateway, web
        sockets = listening_sockets(tree)
        # gRPC (coordinator, stages, gateway), metrics (4) and the data plane's listeners are all there ...
        ports = {port for _, _, port in sockets}
        assert {metrics, metrics + 1, metrics + 2, metrics + 3} <= ports
        assert len(sockets) >= 4 + 4 + 1
        # ... and every one of them is on loopback.
        outside = [(pid, addr, port) for pid, addr, port in sockets if addr not in ("127.0.0.1", "::1")]
        assert outside == [], sockets
        print("listening:", sorted(sockets, key=lambda s: s[2]))
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0


def _free_port_block(n: int) -> int:
    """A base port whose next n ports were free a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            probes = []
            for i in range(n):
                p = socket.socket()
                probes.append(p)
                p.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for p in probes:
                p.close()
    raise RuntimeError("no free block of ports")


@pytest.mark.unit
def test_the_revocation_watch_ends_only_streams_whose_token_is_gone_or_changed_tenant(tmp_path):
    import grpc as grpc_mod

    from gateway.edge.revocation import RevocationWatch
    from gateway.stream.timers import Timers
    from stagecast.security import TokenAuth

    path = tmp_path / "tokens"
    path.write_text(f"{TOKENS['alice']} alice\n{TOKENS['bob']} bob\n{TOKENS['carol']} carol\n")
    auth = TokenAuth(path, reload_s=0)

    class Run:
        def __init__(self, tenant, token):
            self.tenant, self.outcome, self.failed = tenant, None, None
            self.credentials = (("authorization", f"Bearer {token}"),)

        def fail(self, code, message, outcome):
            self.failed, self.outcome = (code, message), outcome

    runs = [Run("alice", TOKENS["alice"]), Run("bob", TOKENS["bob"]), Run("carol", TOKENS["carol"])]
    timers = Timers()
    watch = RevocationWatch(auth, lambda: runs, timers, check_s=3600)  # checked by hand below
    try:
        watch._check()
        assert [r.failed for r in runs] == [None, None, None]
        path.write_text(f"{TOKENS['alice']} alice\n{TOKENS['bob']} mallory\n")  # carol revoked, bob's token moved
        watch._check()
        assert runs[0].failed is None
        for run, tenant in ((runs[1], "bob"), (runs[2], "carol")):
            code, message = run.failed
            assert (
                code == grpc_mod.StatusCode.UNAUTHENTICATED
                and f"token revoked: the token of tenant {tenant!r}" in message
            )
    finally:
        watch.stop()
        timers.close()
