"""The Tinker API's pieces that its routers (api/routes/tinker_*.py) share: the SDK's key, its
errors, and the sessions' jobs (docs/sessions.md)."""
