"""The faults the demo can inject (``--inject FAULT@STEP``): a leaf, so the CLI checks the flag without
importing the demo and the demo names them without importing the CLI."""

FAULTS = ("nan", "grad_spike", "fragmentation", "loader_stall", "none")
