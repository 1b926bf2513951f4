"""Accuracy on a task's held-out problems, through any Engine (greedy, or sampled at a temperature)."""
from __future__ import annotations

from dataclasses import dataclass

from colorl.engines.base import Engine, GenerationRequest, SamplingParams
from colorl.models import encode_chat
from colorl.tasks.base import Problem


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # mean reward over problems x samples
    problems: int
    samples: int


def evaluate(engine: Engine, problems: list[Problem], reward_fn, tokenizer, max_new_tokens: int,
             samples: int = 1, temperature: float | None = None, seed: int = 0,
             system_prompt: str | None = None, stop_ids: tuple[int, ...] = ()) -> EvalResult:
    """Greedy when `temperature` is None (top-k 1, which every engine supports), else sampled."""
    requests = []
    for i, problem in enumerate(problems):
        ids = encode_chat(tokenizer, problem.prompt, system_prompt)
        for s in range(samples):
            params = SamplingParams(temperature=temperature or 1.0, top_k=1 if temperature is None else 0,
                                    max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                                    seed=seed * 7919 + i * samples + s)
            requests.append(GenerationRequest(f"eval-{i}-{s}", ids, params))
    results = engine.generate(requests)
    total = 0.0
    for request_index, result in enumerate(results):
        problem = problems[request_index // samples]
        completion = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        total += reward_fn(problem.prompt, completion, problem.answer)
    return EvalResult(accuracy=total / max(len(results), 1), problems=len(problems), samples=samples)
