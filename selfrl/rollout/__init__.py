"""Rollouts: the agent loop over tasks and tools, and sampling one batch ahead."""
