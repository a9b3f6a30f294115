"""The OpenAI-compatible HTTP server: tenancy, admission, admin API, metrics, audit log (`loraplex
serve`)."""
