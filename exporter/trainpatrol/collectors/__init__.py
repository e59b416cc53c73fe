"""Prometheus custom collectors, one file each. Every collector yields fresh families per scrape."""
