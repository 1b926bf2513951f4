"""The start-up check between trainer and engine names: every mismatch names the tensor."""
from __future__ import annotations

import pytest
import torch

from colorl.sync.name_maps import NameMap, NameMapError, TensorSpec, canonical_name, name_map_for, route

LLAMA = name_map_for("llama")
F32 = torch.float32


def specs(**shapes):
    return {name.replace("__", "."): TensorSpec(shape, F32) for name, shape in shapes.items()}


TRAINER = specs(model__embed_tokens__weight=(10, 4), model__norm__weight=(4,))


def test_identity_routes_and_a_tied_head_fed_by_the_embedding():
    assert route(LLAMA, TRAINER, TRAINER) == {n: [n] for n in TRAINER}
    engine = {**TRAINER, "lm_head.weight": TensorSpec((10, 4), F32)}
    assert route(LLAMA, TRAINER, engine)["model.embed_tokens.weight"] == ["model.embed_tokens.weight", "lm_head.weight"]


def test_untied_head_is_its_own_tensor():
    trainer = {**TRAINER, "lm_head.weight": TensorSpec((10, 4), F32)}
    assert route(LLAMA, trainer, trainer)["lm_head.weight"] == ["lm_head.weight"]


def test_engine_weight_not_covered():
    engine = {**TRAINER, "model.extra.weight": TensorSpec((3,), F32)}
    with pytest.raises(NameMapError, match="engine weight model.extra.weight is not covered"):
        route(LLAMA, TRAINER, engine)


def test_trainer_tensor_without_engine_weight():
    with pytest.raises(NameMapError, match="trainer tensor model.norm.weight maps to model.norm.weight"):
        route(LLAMA, TRAINER, {"model.embed_tokens.weight": TensorSpec((10, 4), F32)})


@pytest.mark.parametrize("spec", [TensorSpec((4, 1), F32), TensorSpec((4,), torch.int64)])
def test_shape_or_dtype_mismatch(spec):
    engine = {**TRAINER, "model.norm.weight": spec}
    with pytest.raises(NameMapError, match=r"engine weight model.norm.weight is .* but trainer tensor model.norm.weight"):
        route(LLAMA, TRAINER, engine)


def test_an_engine_may_serve_another_float_dtype():
    """fp32 master weights, bf16 serving: routed, the checkpoint engine casts."""
    engine = {name: TensorSpec(spec.shape, torch.bfloat16) for name, spec in TRAINER.items()}
    assert route(LLAMA, TRAINER, engine) == route(LLAMA, TRAINER, TRAINER)


def test_engine_weight_covered_twice():
    folding = NameMap("test", renames=((r"^model\.norm\.", "model.embed_tokens."),))
    trainer = specs(model__embed_tokens__weight=(4,), model__norm__weight=(4,))
    with pytest.raises(NameMapError, match="covered twice"):
        route(folding, trainer, specs(model__embed_tokens__weight=(4,)))


def test_unknown_family():
    with pytest.raises(NameMapError, match="no weight name map for model family 'gpt2'"):
        name_map_for("gpt2")


def test_peft_names_are_canonical():
    assert canonical_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert canonical_name("model.norm.weight") == "model.norm.weight"
