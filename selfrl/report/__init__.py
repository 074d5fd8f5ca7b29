"""Reports read from the store: a run's, a server's, and several runs compared."""
