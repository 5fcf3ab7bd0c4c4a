"""Data parallelism: the gradient reducer and the ranks' agreement, sharded host state, and the
start-of-phase exchange that keeps the ranks in step."""
