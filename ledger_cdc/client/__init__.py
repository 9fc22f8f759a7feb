"""What agent workers import: appending (``writer``), reading (``read``), recovery
(``recovery``), durable runs (``runs``), the outbox dispatcher (``dispatch``), live tails
(``tail``). One implementation for sync and async (``steps``)."""
