"""Figures (matplotlib with the Agg backend, no torch): one run's trajectory, a sweep's regime
diagram and fits, and the experiments' figures."""
