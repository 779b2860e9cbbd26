"""The engines dsforge drives internals of are installed at exactly the pinned versions."""

from __future__ import annotations

import configparser
import re
from importlib.metadata import version

import pytest

from tests.conftest import REPO


def _pins() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pins = {}
    for line in cfg["options"]["install_requires"].strip().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line.strip())
        if match:
            pins[match[1]] = match[2]
    return pins


def test_deepspeed_and_megatron_core_are_pinned():
    assert set(_pins()) == {"deepspeed", "megatron-core"}


@pytest.mark.parametrize("package, pinned", sorted(_pins().items()))
def test_installed_version_matches_the_pin(package, pinned):
    assert version(package) == pinned, (
        f"{package} {version(package)} is installed but dsforge pins {pinned}: re-run the "
        "README's install command, or re-check docs/validation.md and the CPU backend facts "
        "before moving the pin")


def test_megatron_dataset_internals_dsforge_relies_on():
    """dsforge/data/samples.py leaves unread parts out by setting them to None in the config's
    split_matrix, which the builder reads per part; and gives GPTDataset a tokenizer stand-in
    whose pad raises (Megatron then pads with -1, no real id)."""
    import dataclasses
    import inspect

    from megatron.core.datasets import blended_megatron_dataset_builder as builder
    from megatron.core.datasets import megatron_dataset
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig

    assert "split_matrix" in {f.name for f in dataclasses.fields(BlendedMegatronDatasetConfig)}
    assert "self.config.split_matrix" in inspect.getsource(builder.BlendedMegatronDatasetBuilder)
    assert megatron_dataset._PAD_TOKEN_ID == -1


def test_deepspeed_optimizer_state_internals_dsforge_relies_on():
    """dsforge/runtime/checkpoint/zero_state.py reads and writes the optimizer state where each ZeRO stage
    keeps it (layout-free checkpoints): these attributes and their meaning must not move."""
    import dataclasses
    import importlib
    import inspect

    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2

    # deepspeed.utils re-exports a class under the module's name: import the module itself.
    tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
    fields = {f.name for f in dataclasses.fields(tensor_fragment.tensor_fragment)}
    assert {"lp_fragment_address", "hp_fragment_address"} <= fields
    assert [f.name for f in dataclasses.fields(tensor_fragment.fragment_address)] == ["numel", "start"]
    zero12 = inspect.getsource(stage_1_and_2.DeepSpeedZeroOptimizer)
    for text in ("self.bit16_groups", "self.single_partition_of_fp32_groups", "def update_lp_params",
                 "self._link_all_hp_params()"):
        assert text in zero12, text
    zero3 = stage3.DeepSpeedZeroOptimizer_Stage3
    for method in ("_get_param_partition_group", "get_local_fp32_param", "set_local_hp_param"):
        assert hasattr(zero3, method), method
    source3 = inspect.getsource(zero3)
    for text in ("self.fp32_partitioned_groups_flat", "self.fp16_partitioned_groups_flat",
                 "self.fp16_partitioned_groups", "self.unflatten"):
        assert text in source3, text
    assert "param.ds_tensor.ds_numel = partition_size" in inspect.getsource(partition_parameters)
    assert "self.fp32_groups.append" in inspect.getsource(FP16_UnfusedOptimizer)
    assert "self.fp32_groups_flat" in inspect.getsource(FP16_Optimizer)


def test_megatron_numbers_experts_as_dsforge_names_them():
    """ckpt/names.py: global expert id = expert-parallel rank x local experts + local id."""
    import inspect

    from megatron.core.transformer.moe.experts import SequentialMLP

    source = inspect.getsource(SequentialMLP)
    assert "local_expert_indices_offset = self.ep_group.rank() * self.num_local_experts" in source


def _source(function) -> str:
    """A method's text; DeepSpeed wraps some methods for NVTX ranges without functools.wraps:
    the original is the wrapper's one closed-over function."""
    import inspect

    inner = [c.cell_contents for c in function.__closure__ or ()
             if inspect.isfunction(c.cell_contents)]
    return inspect.getsource(inner[0] if function.__name__ == "wrapped_fn" else function)


def test_deepspeed_reduces_zero2_gradients_of_a_backward_it_did_not_start():
    """dsforge/runtime/loop/step.py `per_backward_reduction`: under Megatron-Core's schedule each
    chunk's backward starts at DeepSpeed's output hook (the engine's backward prologue) and
    ends in its torch-style post-backward hook (the epilogue: ZeRO-2's reduce-scatter); step()
    of the unmanaged accumulation then only finalises the partition. Each piece must stay."""
    import inspect

    from deepspeed.runtime import base_optimizer, engine, utils
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from megatron.core.pipeline_parallel import schedules

    assert {"outputs", "preprocess_once_fn", "preprocess_per_tensor_fn"} <= set(
        inspect.signature(utils.register_output_backward_hooks).parameters)
    engine_cls = engine.DeepSpeedEngine
    init = _source(engine_cls.__init__)
    assert "self._support_torch_style_backward = True" in init
    assert "self.optimizer.register_grad_acc_post_hook(self._backward_post_hook)" in init
    prologue = _source(engine_cls._backward_prologue)
    for text in ("self.optimizer.enter_backward()", "self.optimizer.queue_post_backward_callback()"):
        assert text in prologue, text
    assert "self._backward_epilogue()" in _source(engine_cls._backward_post_hook)
    assert "self.allreduce_gradients()" in _source(engine_cls._backward_epilogue)
    assert "self.optimizer.overlapping_partition_gradients_reduce_epilogue()" in \
        _source(engine_cls.allreduce_gradients)
    assert "self.optimizer.clear_backward_seen_flag()" in _source(engine_cls.forward)
    assert "self.optimizer.finalize_gradient_accumulation_boundary()" in \
        _source(engine_cls.step)
    # Why the hook state is cleared before each backward: enter_backward only resets it at
    # depth 0 before any backward of the "step" (a forward), and a queued callback is not
    # queued again until then.
    state = base_optimizer.BackwardHookStateManager
    assert "if self.backward_active_depth == 0 and not self.backward_seen_this_step:" in \
        _source(state.enter_backward)
    assert "self.post_backward_callback_queued = False" in _source(state.reset_for_new_step)
    assert hasattr(DeepSpeedZeroOptimizer, "_backward_active_depth")
    assert "self.reduce_ipg_grads()" in \
        _source(DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue)
    # The schedule divides each microbatch loss by the number of microbatches itself (dsforge's
    # loss function returns two values: the legacy averaging branch).
    assert "output_tensor, loss_reduced = outputs" in _source(schedules.forward_step_calc_loss)
    assert "output_tensor /= num_microbatches" in _source(schedules.forward_step_calc_loss)


def test_zero3_under_a_pipeline_schedule_relies_on_these_internals():
    """dsforge/runtime/loop/step.py `_accumulate_from_zero` and engine.py
    `_count_replicated_grads_once_per_stage`: ZeRO-3 copies a backward's gradient partition
    only while `micro_step_id` is 0 and adds into `grad_partitions_flat_buffer` otherwise;
    it counts a replicated parameter's norm where `model_parallel_rank` is 0 and takes that rank
    from the mpu's tp x pp group (stages 1 and 2 take the tensor-parallel rank)."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    stage3_cls = stage3.DeepSpeedZeroOptimizer_Stage3
    partition = _source(stage3_cls.partition_grads)
    assert "if self.micro_step_id == 0:  # don't accumulate" in partition
    assert "grad_buffer.add_(" in partition
    init = _source(stage3_cls.__init__) + _source(stage3_cls._setup_for_real_optimizer)
    assert "self.model_parallel_rank = mpu.get_model_parallel_rank()" in init
    assert "self.grad_partitions_flat_buffer.narrow(" in init
    assert "(self.model_parallel_rank == 0)" in _source(stage3_cls.get_grad_norm_direct)
    assert "self.micro_step_id += 1" in _source(stage3_cls.clear_backward_seen_flag)
    assert "self.model_parallel_rank = bwc_tensor_model_parallel_rank(mpu)" in \
        _source(stage_1_and_2.DeepSpeedZeroOptimizer.__init__)


def test_the_optimizer_step_allocates_what_the_memory_model_says():
    """estimate/memory.py counts DeepSpeed's fp32 gradient at the optimizer step, not at the
    backward: stages 1/2 make it per parameter group in `step()` (after freeing the gradients
    outside the partition) and free it after; stage 3 makes and frees it per sub-group of
    `sub_group_size` (translation sets DeepSpeed's default, 1e9); bf16 without ZeRO runs
    FP16_UnfusedOptimizer around torch's AdamW, which gives each fp32 master an fp32 copy of
    its gradient in `step()`, and FP16_Optimizer around DeepSpeed's FusedAdam, which makes fp32
    copies of the gradients and their flat."""
    from deepspeed.runtime import engine
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from dsforge.estimate.memory import SUB_GROUP_SIZE

    step12 = _source(stage_1_and_2.DeepSpeedZeroOptimizer.step)
    order = ["self.free_grad_in_param_list(self.params_not_in_partition[i])",
             "single_grad_partition = flat_grad_partition.to(", "self._optimizer_step(i)",
             "self.single_partition_of_fp32_groups[i].grad = None"]
    at = 0
    for text in order:  # in this order in the branch without offload
        at = step12.index(text, at) + len(text)
    zero3 = stage3.DeepSpeedZeroOptimizer_Stage3
    assert "self.fp32_partitioned_groups_flat[sub_group_id].grad = single_grad_partition" in \
        _source(zero3._prepare_fp32_grad_for_sub_group)
    assert "self.fp32_partitioned_groups_flat[sub_group_id].grad = None" in _source(zero3._release_sub_group)
    assert DeepSpeedZeroConfig().sub_group_size == SUB_GROUP_SIZE  # translation restates it
    assert "return FP16 if model_dtype == torch.float16 else DDP_BFLOAT16" in \
        _source(engine.DeepSpeedEngine._do_optimizer_sanity_check)
    assert "p.grad.to(data_type)" in _source(FP16_Optimizer.step)
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    assert "fp32_param.grad = fp16_param.grad.to(fp32_param.dtype)" in \
        _source(FP16_UnfusedOptimizer.step)
    assert "use_fused_optimizer = isinstance(optimizer, fused_opts)" in \
        _source(engine.DeepSpeedEngine._configure_fp16_optimizer)


def test_deepspeed_passes_torch_adamw_its_parameters():
    """translate/optimizer.py asks for torch's AdamW through the config: DeepSpeed pops
    torch_adam and foreach and hands the other params (fused among them) to torch.optim.AdamW."""
    from deepspeed.runtime import engine

    configure = _source(engine.DeepSpeedEngine.get_optimizer_configuration)
    assert "torch_adam = optimizer_parameters.pop(TORCH_ADAM_PARAM, False)" in configure
    assert "return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), {'foreach': foreach}" \
        in configure
    assert "optimizer = adam_optimizer(model_parameters, **optimizer_parameters, **adam_optimizer_kwargs)" \
        in _source(engine.DeepSpeedEngine._configure_basic_optimizer)


def test_the_guard_relies_on_these_internals():
    """runtime/guard/health.py: DeepSpeed drops an update whose gradient norm is not finite at
    ZeRO 1-3 (is_invalid_grad_norm) and reports it through the optimizer's `overflow`, which the
    engine reads to count the skip and hold the schedule; dsforge's fp32 ZeRO-0 step sets the same
    flag (runtime/assemble/engine.py). runtime/loop/data.py names a sample's documents through
    Megatron's GPTDataset and BlendedDataset index attributes."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.gpt_dataset import GPTDataset

    take_step = inspect.getsource(DeepSpeedEngine._take_model_step)
    assert 'overflow = self.optimizer.overflow' in take_step
    assert "self._step_applied = not overflow" in take_step and "self.skipped_steps += 1" in take_step
    assert "self.lr_scheduler.step(" in take_step.split("if overflow:")[1].split("else:")[1]
    assert hasattr(DeepSpeedEngine, "was_step_applied")
    for optimizer in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        # Stage 3's step is wrapped for NVTX: read the method in its class's source.
        body = inspect.getsource(optimizer).split("    def step(self, closure=None):")[1]
        assert "is_invalid_grad_norm(" in body.split("\n    def ")[0]
    query = inspect.signature(GPTDataset._query_document_sample_shuffle_indices)
    assert list(query.parameters) == ["self", "idx"]
    blended = inspect.getsource(BlendedDataset.__getitem__)
    assert "self.dataset_index[idx]" in blended and "self.dataset_sample_index[idx]" in blended


def test_fp16s_loss_scale_is_read_where_dsforge_reads_it():
    """runtime/loop/metrics.py `loss_scale` reads DeepSpeed's fp16 wrappers' `loss_scale`.
    engine.backward multiplies the loss by it for the ZeRO optimizers only (step.py gives the
    MoE aux loss the same scale there); the ZeRO-0 wrappers are no ZeROOptimizer, and their
    step() still divides by it, which rule Z7 refuses. When DeepSpeed scales for them too,
    this fails: drop Z7 then."""
    import inspect

    from deepspeed.runtime import engine
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    source = inspect.getsource(engine)
    backward = source[source.index("    def backward(self, loss"):]
    backward = backward[:backward.index("\n    def ", 10)]
    assert "if isinstance(self.optimizer, ZeROOptimizer):\n                loss = self.optimizer.scale_if_loss(loss)" in backward
    for zero0 in (FP16_Optimizer, FP16_UnfusedOptimizer):
        assert not issubclass(zero0, ZeROOptimizer)
        assert "return self.loss_scale_config.cur_scale" in inspect.getsource(zero0.loss_scale.fget)
        assert "self.loss_scale_config.cur_scale" in inspect.getsource(zero0.unscale_and_clip_grads)
    for sharded in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert issubclass(sharded, ZeROOptimizer)
        assert "return self.loss_scaler.cur_scale" in inspect.getsource(sharded.loss_scale.fget)


def test_grouped_experts_rely_on_these_internals():
    """runtime/assemble/grouped_moe.py: MoELayer's forward goes route -> preprocess -> dispatch ->
    routed_experts_compute -> combine -> postprocess (dsforge's on-device dispatch overrides the
    four after route); the experts are called with (tokens sorted by expert, the count per
    expert, their probabilities) and keep their weights in local_experts[i].linear_fc1/fc2."""
    import inspect

    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    forward = inspect.getsource(MoELayer.forward)
    calls = ["self.route(", "self.preprocess(", "self.dispatch(", "self.routed_experts_compute(",
             "self.combine(", "self.postprocess("]
    positions = [forward.index(call) for call in calls]
    assert positions == sorted(positions)
    compute = inspect.getsource(MoELayer.routed_experts_compute)
    assert "self.experts(dispatched_input, tokens_per_expert, permuted_probs)" in compute
    assert list(inspect.signature(SequentialMLP.forward).parameters) == [
        "self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs"]
    assert "self.local_experts = torch.nn.ModuleList()" in inspect.getsource(SequentialMLP.__init__)


def test_calibrating_moe_layers_relies_on_these_internals():
    """calibrate/layer_timing.py empties Megatron's layer-wise aux-loss tracker between models of
    different layer counts: a dict, its tensors sized by the first model's layers."""
    import inspect

    from megatron.core.transformer.moe import moe_utils

    assert isinstance(moe_utils.get_moe_layer_wise_logging_tracker(), dict)
    assert 'torch.zeros(num_layers, device=loss.device)' in \
        inspect.getsource(moe_utils.save_to_aux_losses_tracker)
