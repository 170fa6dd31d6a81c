"""Layerwise profiling of engine steps: `headrace profile` (run.py) records per-module and
per-op tables with torch.profiler (the core is layerwise.py); `headrace profile-table`
(table.py) and `headrace profile-plot` (plot.py) read the JSON it saves."""
