"""Reference figures from seeds/staleness-formulas-applied-compute.txt, for tests and benches."""

# The seed's table of six Qwen3-8B runs: C, B, q, ρ, M_tail, seed's predicted, seed's measured.
SEED_RUNS = [
    (120, 240, 2, 0.63, 1.42, 1.34, 1.26),
    (240, 120, 2, 0.92, 1.43, 3.86, 3.59),
    (128, 128, 2, 1.07, 1.44, 3.29, 3.09),
    (240, 120, 1, 0.86, 1.42, 3.34, 3.40),
    (120, 120, 1, 0.67, 1.42, 1.95, 1.92),
    (128, 128, 1, 1.14, 1.45, 2.24, 2.01),
]
