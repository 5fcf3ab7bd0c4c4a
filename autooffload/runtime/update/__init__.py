"""The update engine: the CPU optimizer of offloaded chunks (masters, twins, worker), its gradient
staging, the update in the backward, the GPU update path and the auto mode that chooses it."""
