"""From replication bytes to committed ledger transactions: the transport (``transport``), the
transaction assembler (``assemble``), value loading (``values``), ledger rows (``ledger``) and
routing with dead letters and heartbeats (``route``). Pure apart from the transport."""
