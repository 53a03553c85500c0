"""Routing: round-robin/random/direct, and KV-cache-aware selection."""
