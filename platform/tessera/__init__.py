"""Tessera platform application (APIs, auth, quotas, billing, CLI). Imported as `tessera`."""
