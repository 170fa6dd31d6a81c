"""The tools outside the services: benchmarks (`headrace bench`, bench/) and the layerwise
profiler (`headrace profile`, profiler/). They drive headrace only through its public
seams (the offline engine, the launcher, HTTP, and the few entry points the gateway and
worker packages export; tests/test_architecture.py holds the list). This directory also
keeps the committed results and the GPU scripts (gpu/), which are not part of the package."""
