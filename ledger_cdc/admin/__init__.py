"""What an operator runs: schema and roles (``schema``), slot health (``health``), retention
(``partitions``), proofs (``verify``), history (``timeline``, ``importer``)."""
