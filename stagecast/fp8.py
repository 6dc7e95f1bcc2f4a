"""Where ``--fp8`` can run: the start-up check every floor shares (stage, ``stagecast up``, benchmarks).

``--fp8`` turns a stage's transformer-block linear layers into torchao's float8 dynamic-activation, float8-weight
linears (rowwise scales, ``stage_service/fp8.py``).  It is opt-in and GPU only, and it is refused at start-up,
before any weights are read, with one line naming the flag:

- on a CPU (``--device cpu``) or where no CUDA GPU is visible;
- on a GPU of compute capability below 8.9 (float8 matmuls need Ada, Hopper or newer);
- with a ``--dtype`` other than bfloat16 (torchao's float8 linears take and give bfloat16);
- where torchao cannot be imported (the ``fp8`` extra: ``pip install stagecast[fp8]``).

Usage::

    check_fp8("cuda:0", "bfloat16")                        # raises Fp8Unavailable("--fp8: ...") or returns
    fp8_refusal("cpu", "bfloat16", [], None)               # the reason as text (pure: the tests' entry point)
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
DTYPE = "bfloat16"
# torchao 0.17.0 is built against torch 2.11 (the device machine's) and is ABI-stable from there on.
TORCHAO_TESTED = "0.17.0"


class Fp8Unavailable(ValueError):
    """``--fp8`` cannot run here; the message starts with ``--fp8:`` and says why."""


def fp8_refusal(
    device: str,
    dtype: str,
    capabilities: Sequence[tuple[int, int]],
    torchao_error: str | None,
) -> str | None:
    """Why ``--fp8`` cannot run, or None.  ``capabilities``: compute capability of each GPU the process would use
    (empty: none visible); ``torchao_error``: why torchao could not be imported (None: it imports).  The first
    reason wins, in the order: device, capability, dtype, torchao."""
    if not device.startswith("cuda"):
        return f"--fp8: needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); --device is {device}"
    if not capabilities:
        return f"--fp8: needs a CUDA GPU of compute capability 8.9 or newer; no CUDA GPU is visible for {device}"
    low = min(capabilities)
    if tuple(low) < MIN_CAPABILITY:
        return f"--fp8: needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {device} has {low[0]}.{low[1]}"
    if dtype != DTYPE:
        return f"--fp8: needs --dtype {DTYPE} (float8 linears take and give bfloat16), got --dtype {dtype}"
    if torchao_error is not None:
        return (
            f"--fp8: needs torchao (pip install 'stagecast[fp8]'; torchao {TORCHAO_TESTED} matches torch 2.11): "
            f"{torchao_error}"
        )
    return None


def _capabilities(device: str) -> list[tuple[int, int]]:
    """Compute capabilities of the GPUs ``device`` names (``cuda``: every visible one); empty if none is there."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    if device == "cuda":
        indices = list(range(count))
    else:
        try:
            index = int(device.split(":", 1)[1])
        except (IndexError, ValueError):
            return []
        if not 0 <= index < count:
            return []
        indices = [index]
    return [tuple(torch.cuda.get_device_capability(i)) for i in indices]


def _torchao_error() -> str | None:
    try:
        import torchao.quantization  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a missing or broken install: either way --fp8 cannot run
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def check_fp8(device: str, dtype: str) -> None:
    """Raise ``Fp8Unavailable`` (a ValueError naming ``--fp8``) unless this machine can run ``--fp8`` on ``device``.
    Cheap checks first: on a CPU this imports neither torch's CUDA runtime nor torchao."""
    if not device.startswith("cuda"):
        reason = fp8_refusal(device, dtype, [], None)
    else:
        caps = _capabilities(device)
        reason = fp8_refusal(device, dtype, caps, None)
        if reason is None:
            reason = fp8_refusal(device, dtype, caps, _torchao_error())
    if reason is not None:
        raise Fp8Unavailable(reason)


__all__ = ["DTYPE", "MIN_CAPABILITY", "TORCHAO_TESTED", "Fp8Unavailable", "check_fp8", "fp8_refusal"]
