"""Agent frameworks on the ledger: each takes a storage backend through a small interface."""
