"""`colorl bench`: run colocated and bounded-lag variants of one workload side by side."""
