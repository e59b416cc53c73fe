"""The agent's collectors: prometheus_client collectors that also say cheaply when they have something
new (``version``); collectors.registry writes /metrics from them."""
