"""What a run keeps on disk: the store, the version ledger, the adapter folders."""
