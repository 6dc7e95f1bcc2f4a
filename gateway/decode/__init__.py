"""Where latents become frames: the decoders, the batched tiny decoder, the streaming VAE, its graphs, cost and
stage."""
