"""What a step keeps beside the weights: per-block activation policies (keep, checkpoint,
checkpoint with inputs on the host, swap), the host buffers of swapped activations, MLPs tiled
along the sequence, and the cross-entropy computed in chunks."""
