"""Models (Flax NNX) and their loading."""
