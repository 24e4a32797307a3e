"""Statistics of finished runs (numpy/scipy, no torch): λ_c and ν fits with bootstrap intervals,
paired tests, predictive value, trajectories and stages, per-head dimension, and the report behind
both ``fastdiag analyze`` and ``fastdiag plot``."""
