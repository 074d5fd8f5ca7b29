"""What stands between an update and serving: the gate, collapse rules, detectors, swap check."""
