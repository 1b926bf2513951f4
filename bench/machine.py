"""What a bench's figures hold for: the CPU model, its family and the flags that change which kernels run
(figures differ by CPU). One definition, colorl.machine's, for the benches, CI's log and colorl doctor."""
from __future__ import annotations

from colorl.machine import cpu_summary as cpu_model

__all__ = ["cpu_model"]
