"""The core: what computes the head statistics, the layer every other part stands on.

* ``stats``        `HeadStats`, the sufficient statistics (Gram, entropy sums, rows), and what is
                   derived from them: s̄, σ_H, per-head entropies, `summarize` over layers.
* ``diagnostics``  `head_stats(probs)`, the entry point from post-softmax probabilities, and the
                   backend dispatch (reference, torch, triton).
* ``qk``           statistics straight from Q and K (``fastdiag.qk`` is its public name).
* ``adapters``     how `attach` finds and measures the attention of real models (softmax, SDPA, MHA).
* ``monitor``      `attach` / `Monitor`; ``records`` keeps what a monitor measured.
* ``zoo_handoff``  the attributes a monitor lends to fastdiag's own model-zoo attention modules.
* ``kernels``      float64 references, the CPU path and the Triton kernels.

Nothing here imports the experiment stack (grokking, sweep, store, analysis, plots) or the CLI.
"""
