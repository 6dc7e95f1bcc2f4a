"""Model facts every floor shares: named configs, config reading, key layouts and layer partitions.

- ``dit_configs``: ``model_config("wan2.1-1.3b")``, the transformer presets (real sizes and tiny ones).
- ``vae_configs``: ``vae_config("wan2.1")``, the VAE presets and their spatial/temporal factors.
- ``config``: ``read_config`` / ``read_vae_config`` for checkpoint folders (diffusers or Wan-AI layout).
- ``wan_keys``: the original Wan / CausVid / Self-Forcing key and config layout against diffusers'.
- ``partition``: ``parse_partition`` and ``partition_ranges`` for cutting the layers into stages.
- ``balance``: ``plan_balance``, the partition and the VAE cut chosen together from measured times per GPU;
  ``balance_profile``: the JSON those times come in (made by ``benchmarks/balance.py``).
"""
