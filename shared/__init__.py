"""What the API and the worker both import, and nothing that only one of them does: the job
kinds and their specs, the job records and their lifecycle, routing and the memory estimate,
the Redis key layout, settings, and the other pieces both sides read (docs/architecture.md)."""
