"""colorl's own inference engine: paged KV cache, continuous batching, partial rollout.

Pieces, each small and separately testable: `block_manager` (KV blocks, prefix sharing) and
`scheduler` (continuous batching, chunked prefill, preemption) are pure Python; `model` (Llama /
Qwen2 / Qwen3 with HF weight names), `model_runner` (tensors for a step, paged attention) and
`sampler` (temperature / top-k / top-p with exact log-probs) are torch; `engine` wires them up.
`NativeEngine` is imported lazily so the policy modules load without the model code.
"""

__all__ = ["NativeEngine"]


def __getattr__(name: str):
    if name == "NativeEngine":
        from colorl.engines.native.engine import NativeEngine

        return NativeEngine
    raise AttributeError(name)
