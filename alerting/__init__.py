"""trainpatrol's Prometheus rules as code: one config of selectors and thresholds, rendered to YAML.

``python alerting/generate.py`` writes ``alerting/rules.yml``; ``--profile fast`` renders the same
rules with short windows and ``for: 0s`` for end-to-end tests.
"""
