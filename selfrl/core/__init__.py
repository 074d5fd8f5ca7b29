"""The records every stage passes along: trajectories, tasks and tools (imports nothing of selfrl)."""
