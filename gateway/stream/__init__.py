"""A gateway stream's life: its run, its client side, frames, trace, the pipeline link and its warm-up."""
