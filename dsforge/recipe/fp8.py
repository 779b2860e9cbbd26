"""Rules FP1-FP5: what train.fp8 (float8 GEMMs in the transformer layers' linear layers,
runtime/assemble/fp8.py) needs of the recipe, whatever the device (translate/fp8.py checks the
devices)."""

from __future__ import annotations

from dsforge.problems import Problem

FP8_ALIGN = 16  # torch._scaled_mm: both dimensions of each weight a multiple of 16


def fp8_recipe_problems(recipe, micro_batch: int | None) -> list[Problem]:
    """FP1-FP5: what float8 GEMMs need of the recipe, whatever the device. `micro_batch`:
    the resolved one where the world is known (None: the token check waits for it)."""
    train, model = recipe.train, recipe.model
    if train.fp8 == "none":
        return []
    field = {"train.fp8": train.fp8}
    problems = []
    if train.precision != "bf16":
        problems.append(Problem(rule="FP1", fields={**field, "train.precision": train.precision},
                                message="float8 GEMMs sit inside a bf16 run (the weights, the "
                                        "rest of the model and the gradients stay bf16)",
                                fix="use train.precision: bf16 with train.fp8"))
    if recipe.parallel.tp > 1:
        problems.append(Problem(rule="FP2", fields={**field, "parallel.tp": recipe.parallel.tp},
                                message="dsforge's float8 linear layers compute one rank's whole "
                                        "product (no tensor-parallel gather or reduction inside)",
                                fix="use parallel.tp: 1 with train.fp8 (dp, pp and cp split "
                                    "the work instead), or train.fp8: none"))
    if recipe.zero.stage == 3:
        problems.append(Problem(rule="FP3", fields={**field, "zero.stage": 3},
                                message="torchao keeps a view of each gathered weight for the "
                                        "backward, so ZeRO-3 could not free a layer's weights "
                                        "until its backward: every layer's would stay gathered",
                                fix="use zero.stage: 0, 1 or 2 with train.fp8"))
    if model.moe is not None:
        problems.append(Problem(rule="FP4", fields={**field, "model.moe": "set"},
                                message="float8 GEMMs are for the dense layers' linear layers; "
                                        "expert GEMMs are not converted",
                                fix="use train.fp8: none for MoE models"))
    odd = {f"model.{name}": width for name, width in linear_widths(model).items() if width % FP8_ALIGN}
    tokens = (micro_batch or 0) * train.seq_len // recipe.parallel.cp
    if tokens % FP8_ALIGN:  # the weight gradient's product runs over a microbatch's tokens
        odd.update({"train.micro_batch": micro_batch, "train.seq_len": train.seq_len})
    if odd:
        problems.append(Problem(rule="FP5", fields={**field, **odd},
                                message=f"float8 GEMMs need every product's dimensions to be "
                                        f"multiples of {FP8_ALIGN}: the linear layers' widths and "
                                        "a microbatch's tokens (on one context-parallel rank)",
                                fix="choose widths and a sequence length that are multiples of "
                                    "16, or train.fp8: none"))
    return problems


def linear_widths(model) -> dict[str, int]:
    """The widths a transformer layer's linear layers have (their inputs and outputs)."""
    return {"hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_hidden_size,
            "kv_channels": model.head_dim}
