"""Observability: trace.py (per-batch pipeline timelines) and metrics.py (the server's Prometheus metrics)."""
