"""Named config presets with checked overrides, shared by the DiT and VAE config tables.

Usage::

    cfg = named_config(CONFIGS, "tiny-wan2.1", "model", num_layers=2)   # a fresh deep copy
"""

from __future__ import annotations

import copy


def named_config(table: dict[str, dict], name: str, kind: str, **overrides) -> dict:
    """Return a fresh copy of ``table[name]`` with ``overrides`` applied; unknown names or keys raise KeyError."""
    if name not in table:
        raise KeyError(f"unknown {kind} config {name!r}; known: {', '.join(sorted(table))}")
    cfg = copy.deepcopy(table[name])
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise KeyError(f"unknown {kind} config keys for {name!r}: {sorted(unknown)}")
    cfg.update(overrides)
    return cfg
