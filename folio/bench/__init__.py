"""`folio bench serve` and `folio bench throughput`: load generation and measurement."""
