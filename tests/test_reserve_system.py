"""Admission before the prompt is encoded, through a real gateway and coordinator (the shared system: its coordinator
admits MAX_STREAMS streams).  A full pipeline refuses a stream before its prompt is encoded: a prompt past the
encoder's limit is refused RESOURCE_EXHAUSTED there, where with room it is refused INVALID_ARGUMENT by its encode,
and the place its Reserve held is given back at once (the next stream is admitted, not refused for HOLD_S)."""

from __future__ import annotations

import pytest

import stagecast
from stagecast.errors import InvalidArgumentError, ResourceExhaustedError
from tests.shared_system import MAX_STREAMS

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
TOO_LONG = "snow " * 40  # 41 tokens: the demo checkpoint's encoder takes 32
TIMEOUT = 120.0


def test_a_full_pipeline_refuses_before_the_encode_and_a_failed_encode_gives_its_place_back(shared_system):
    with stagecast.Client(shared_system.gateway) as client:
        running = [client.generate(PROMPT, codec="jpeg", timeout=TIMEOUT) for _ in range(MAX_STREAMS)]  # unbounded
        try:
            for gen in running:
                gen.wait_started()
            with pytest.raises(ResourceExhaustedError):  # the coordinator's Reserve: full, before any encode
                client.generate(TOO_LONG, timeout=TIMEOUT).wait_started()
            running.pop().cancel()
            client.wait_for_status(lambda s: s.active_streams == MAX_STREAMS - 1, timeout=TIMEOUT)
            with pytest.raises(InvalidArgumentError, match="prompt"):  # room: admitted, then its encode refuses it
                client.generate(TOO_LONG, timeout=TIMEOUT).wait_started()
            last = client.generate(PROMPT, codec="jpeg", timeout=TIMEOUT)  # the place the bad prompt held is free
            running.append(last)
            assert last.wait_started().total_frames is None
        finally:
            for gen in running:
                gen.cancel()
