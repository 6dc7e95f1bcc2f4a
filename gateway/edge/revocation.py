"""Revoked tokens end their running streams: a stream lives no longer than the token it was opened with.

Usage (the gateway starts one when it asks for tokens)::

    watch = RevocationWatch(auth, runs=gateway_runs, timers=timers)   # checks every CHECK_S on the timers' thread
    watch.start()
    ...
    watch.stop()

``TokenAuth`` re-reads its file when it changes (at most every ``reload_s``, 2 s); every ``CHECK_S`` the watch asks
it again for each running stream's credentials (``StreamRun.credentials``: the call's ``authorization`` metadata) and
ends a stream whose token is gone, or now names another tenant, with UNAUTHENTICATED.  A stream therefore ends
within ``reload_s + CHECK_S`` (3 s) of the tokens file changing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc

from gateway.stream.timers import TimerEntry, Timers
from stagecast.security import TokenAuth

logger = logging.getLogger(__name__)

CHECK_S = 1.0


def credentials_of(context: grpc.ServicerContext) -> tuple[tuple[str, str], ...]:
    """What a stream's token check needs again later: its call's ``authorization`` metadata, and nothing else."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if k == "authorization")


class RevocationWatch:
    def __init__(self, auth: TokenAuth, runs: Callable[[], Iterable], timers: Timers, check_s: float = CHECK_S):
        self.auth = auth
        self.runs = runs
        self.timers = timers
        self.check_s = check_s
        self._entry: TimerEntry | None = None
        self._stopped = False

    def start(self) -> None:
        self._entry = self.timers.call_later(self.check_s, self._check)

    def stop(self) -> None:
        self._stopped = True
        self.timers.cancel(self._entry)

    def _check(self) -> None:
        try:
            for run in self.runs():
                tenant = getattr(run, "tenant", None)
                credentials = getattr(run, "credentials", None)
                if tenant is None or credentials is None or run.outcome is not None:
                    continue
                who = self.auth.principal(credentials)
                if who is None or who.tenant != tenant or not who.may_generate:
                    run.fail(
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"token revoked: the token of tenant {tenant!r} that opened this stream is no longer valid",
                        "unauthenticated",
                    )
        finally:
            if not self._stopped:
                self._entry = self.timers.call_later(self.check_s, self._check)
