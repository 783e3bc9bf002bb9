"""What the API and the worker both need: settings, job schemas, the Redis key layout and job store."""
