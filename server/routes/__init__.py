"""ddpscope package (see the repository README)."""
