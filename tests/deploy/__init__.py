"""Deployment tests: alert rules, Prometheus config, Prometheus end to end."""
