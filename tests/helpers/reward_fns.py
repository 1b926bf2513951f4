"""User reward functions for tests, imported by `module:function` in spawned workers."""


def digit_fraction(prompt: str, completion: str, answer: str) -> float:
    """Dense enough that a random tiny model gets groups with reward variance."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def flaky(prompt: str, completion: str, answer: str) -> float:
    if len(completion) % 2:
        raise ValueError("odd length")
    return 1.0


def long_is_right(prompt: str, completion: str, answer: str) -> float:
    """Coarse on purpose: many groups end up with equal rewards (zero-variance filtering has work)."""
    return 1.0 if len(completion) >= 6 else 0.0
