"""Tensors on the internal wire: a zero tail stays off it, and every tensor comes back bit for bit."""

import pytest
import torch

from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as pb

pytestmark = pytest.mark.unit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_a_padded_text_embedding_travels_as_its_tokens_and_comes_back_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    text = torch.zeros(1, 512, 4096, dtype=torch.bfloat16)
    text[0, :9] = torch.randn(9, 4096, generator=gen).to(torch.bfloat16)
    text[0, 8, -3:] = 0  # the last token's last values are zeros too: they may leave with the tail
    msg = wire.tensor_to_proto(text)
    assert msg.zero_tail and len(msg.data) <= 9 * 4096 * 2 and len(msg.data) > 8 * 4096 * 2
    back = wire.tensor_from_proto(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == text.dtype and back.shape == text.shape
    assert torch.equal(_bits(back), _bits(text))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_every_tensor_round_trips_exactly_and_one_without_a_zero_tail_travels_whole(dtype):
    gen = torch.Generator().manual_seed(1)
    full = (torch.rand(2, 3, 5, generator=gen) * 100 + 1).to(dtype)  # no zero anywhere
    msg = wire.tensor_to_proto(full)
    if dtype != torch.int64:  # a small int64's high bytes are zeros: its last element's leave with the tail
        assert not msg.zero_tail and len(msg.data) == full.numel() * full.element_size()
    for t in (full, torch.zeros(4, 7, dtype=dtype), torch.zeros(0, 3, dtype=dtype), full.new_tensor(5)):
        back = wire.tensor_from_proto(wire.tensor_to_proto(t))
        assert back.shape == t.shape and torch.equal(_bits(back), _bits(t))


def test_negative_zero_is_not_a_zero_tail():
    t = torch.tensor([1.0, -0.0, -0.0], dtype=torch.bfloat16)
    back = wire.tensor_from_proto(wire.tensor_to_proto(t))
    assert torch.equal(_bits(back), _bits(t)) and torch.signbit(back[2].float())


def test_malformed_tensor_messages_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match=r"needs 24 bytes, got 8"):
        wire.tensor_from_proto(pb.Tensor(shape=[2, 3], dtype="float32", data=b"\0" * 8))
    with pytest.raises(ValueError, match=r"needs at most 24 bytes, got 28"):
        wire.tensor_from_proto(pb.Tensor(shape=[2, 3], dtype="float32", data=b"\1" * 28, zero_tail=True))
    # A zero tail is not on the wire, so a shape alone may not ask for more than a message could carry.
    with pytest.raises(ValueError, match=r"over \d+"):
        wire.tensor_from_proto(pb.Tensor(shape=[1 << 20, 1 << 20], dtype="float32", data=b"\1", zero_tail=True))
    with pytest.raises(ValueError, match="negative"):
        wire.tensor_from_proto(pb.Tensor(shape=[-1, 4], dtype="float32", data=b"", zero_tail=True))
