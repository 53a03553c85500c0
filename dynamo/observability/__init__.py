"""Observability: Prometheus metrics (declared once), logging."""
