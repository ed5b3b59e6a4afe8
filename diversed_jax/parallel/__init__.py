"""Device meshes and multi-host start-up: the same programs on 1 CPU, 8 GPUs or a TPU pod."""
