"""The grokking experiments: run configuration and vocabulary (``config``, torch-free), the modular
arithmetic tasks, building a run's model, training one run or a vectorised ensemble of runs, and the
causal interventions."""
