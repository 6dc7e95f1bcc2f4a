"""Few-step flow-matching sampler over a timestep ladder; the step runs on the last slice.

Usage::

    sampler = FlowSampler(spec)              # spec.timesteps e.g. (1000, 750, 500, 250), spec.shift
    x = chunk_noise(spec, chunk, 0)          # level-0 input, deterministic by (seed, chunk)
    t = sampler.model_timestep(level)        # what the transformer is conditioned on
    x = sampler.step(x, flow_pred, level, noise=lambda: chunk_noise(spec, chunk, level + 1))

The ladder holds training timesteps in (0, 1000]; ``shift`` maps them to sigmas the way flow-matching
schedulers do (``sigma = shift*s / (1 + (shift-1)*s)`` with ``s = t/1000``), and the model sees
``sigma * 1000``.  That math is ``stagecast.sampling.sigmas`` / ``model_timestep``, shared by every stage and the
reference executor.  Two update rules (``spec.sampler``):

* ``x0`` (CausVid / Self-Forcing / StreamDiffusionV2): predict ``x0 = x - sigma*v`` and re-noise it to the
  next sigma with fresh noise.  This is what few-step distilled causal models are trained for.
* ``euler``: the deterministic ODE step ``x + (sigma_next - sigma) * v``.

After the last level both return the clean prediction.  All math is fp32 whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stage_service.host_copy import to_device
from stagecast.microstep import StreamSpec
from stagecast.sampling import model_timestep, sigmas


def chunk_noise(spec: StreamSpec, chunk: int, level: int) -> torch.Tensor:
    """Gaussian noise for (stream seed, chunk, level), generated on the CPU so every device agrees."""
    # A fixed odd multiplier spreads (seed, chunk, level) over distinct generator seeds.
    seed = (spec.seed * 1_000_003 + chunk * 1009 + level) % (2**63)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(spec.latent_shape, generator=g, dtype=torch.float32)


class FlowSampler:
    def __init__(self, spec: StreamSpec):
        self.rule = spec.sampler
        self.sigmas = sigmas(spec.timesteps, spec.shift)

    def model_timestep(self, level: int) -> float:
        """The conditioning timestep of a level; the clean pass (level == steps) runs at t = 0."""
        return model_timestep(self.sigmas[level])

    def step(
        self, sample: torch.Tensor, flow: torch.Tensor, level: int, noise: Callable[[], torch.Tensor] | None = None
    ) -> torch.Tensor:
        sigma, sigma_next = self.sigmas[level], self.sigmas[level + 1]
        x = sample.float()
        v = flow.float()
        if self.rule == "euler":
            return x + (sigma_next - sigma) * v
        x0 = x - sigma * v
        if sigma_next == 0.0:
            return x0
        if noise is None:
            raise ValueError("the x0 rule needs fresh noise for every level but the last")
        return (1.0 - sigma_next) * x0 + sigma_next * to_device(noise(), x0.device)
