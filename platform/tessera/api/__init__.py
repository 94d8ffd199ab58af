"""HTTP routers: openai.py (the tenant-facing OpenAI-compatible API) and admin.py."""
