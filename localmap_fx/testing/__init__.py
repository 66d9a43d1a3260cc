"""Test and benchmark helpers shipped with the package (example models, graph printing)."""
