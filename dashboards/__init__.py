"""Grafana dashboards as code: ``python -m dashboards.generate`` writes the JSON beside this package."""
