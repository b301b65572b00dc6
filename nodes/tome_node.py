"""The ToMe patch node: MODEL -> MODEL with token merging on a clone."""

from __future__ import annotations

from dataclasses import replace

from comfy_api.latest import io

from ..tokenreduce.catalog import TOME_NODE
from ..tokenreduce.describe import header, tome_dit_info, tome_info
from ..tokenreduce.layout import DIT, UNET
from ..tokenreduce.methods import TOME, tome_dit_only, tome_select, tome_unet_only, tome_without_frames
from ..tokenreduce.preflight import tome_strides
from ..tokenreduce.tome_dit import ToMeDiTPatch, tome_dit_blocks, tome_refusal
from ..tokenreduce.tome_patch import ToMePatch
from .common import (PatchNode, builtin_tome_applied, done, find_target, patched_clone, reduce_rule,
                     refuse_or_unchanged, refuse_stacking, unet_levels)
from .host import (bind_to_device_copies, hand_options_to_blocks, install_attention_override,
                   install_block_replacements)
from .schema import validate_inputs_for


class ToMePatchNode(PatchNode):
    TEXT = TOME_NODE
    NODE_ID = TOME_NODE.node_id
    METHOD = TOME
    validate_inputs = validate_inputs_for(TOME)

    @classmethod
    def execute(cls, model, **values) -> io.NodeOutput:
        settings = cls.settings(values)
        refuse_stacking(model, cls.NODE_ID)
        if builtin_tome_applied(model):
            raise ValueError(f"{cls.NODE_ID}: ComfyUI's built-in TomePatchModel is already applied to this model. It "
                             f"merges the queries before this node sees them, so this node would be skipped in every "
                             f"block. Use one of the two (this node's mode 'queries only' computes what the built-in "
                             f"does).")
        target = find_target(model, "ToMe", "max_downsample", settings.max_downsample, tome_select, kinds=(UNET, DIT))
        if target.layout is not None and target.layout.kind == DIT and not target.refused:
            return cls._patch_dit(model, settings, target)
        if target.sites is None:
            return refuse_or_unchanged(model, cls.NODE_ID, target)

        # a UNet: no frames, no whole-block merging to correct
        warnings = tome_without_frames(cls.NODE_ID, settings, target.family) + tome_dit_only(settings, target.family)
        title = header("ToMe", target)
        patched, session = patched_clone(model, cls.NODE_ID, settings, title, cls.graph_node(),
                                         preflight=tome_strides(cls.NODE_ID, target.levels, settings.stride_x,
                                                                settings.stride_y))
        patch = ToMePatch(settings, target, session.context_key, cls.NODE_ID, unet_levels(model, target),
                          reduce_rule(settings))
        session.attach(patched, patch)
        patched.set_model_attn1_patch(patch.attn1)
        if patch.proportional:  # the merged keys' log sizes go into the self-attention the attn1 patch merged
            install_attention_override(patched, patch)
        if settings.merge_attn:
            patched.set_model_attn1_output_patch(patch.unmerge_output)
        if settings.merge_crossattn:
            patched.set_model_attn2_patch(patch.attn2)
            patched.set_model_attn2_output_patch(patch.unmerge_output)
        if settings.merge_mlp:
            def merge_mlps(patcher):
                for site in target.sites:
                    feed_forward = patcher.get_model_object(f"{site.path}.ff")  # this copy's own module
                    patcher.add_object_patch(f"{site.path}.ff.forward", patch.mlp_forward(site.key, feed_forward))

            merge_mlps(patched)
            bind_to_device_copies(patched, session.context_key, merge_mlps)
        return done(patched, tome_info(settings, target), title, warnings)

    @classmethod
    def _patch_dit(cls, model, settings, target) -> io.NodeOutput:
        """Whole-block merging through the host's block-replace seam, on the clone."""
        family = target.layout.family
        if family.merge is None:
            raise ValueError(f"{cls.NODE_ID}: {tome_refusal(target.family, family)}")
        if family.merge.frame_grouped and settings.stride_t > 1:
            raise ValueError(f"{cls.NODE_ID}: stride_t {settings.stride_t} cannot be used on this {target.family} "
                             f"model: its blocks group their tokens by latent frame, so ToMe merges within each frame "
                             f"only. Set stride_t to 1.")
        if target.sites is None:
            return refuse_or_unchanged(model, cls.NODE_ID, replace(target, message=(
                f"WARNING: ToMe does nothing on this {target.family} model: it has {len(target.layout.sites)} blocks, "
                f"and ToMe leaves the first and the last whole. The model is returned unchanged.")))
        warnings = ([] if family.video else tome_without_frames(cls.NODE_ID, settings, family.name)) + tome_unet_only(
            settings, family.name)
        title = header("ToMe", target)
        diffusion_model = model.get_model_object("diffusion_model")
        patched, session = patched_clone(model, cls.NODE_ID, settings, title, cls.graph_node())
        patch = ToMeDiTPatch(settings, target.layout, tome_dit_blocks(target.sites), diffusion_model,
                             session.context_key, cls.NODE_ID, reduce_rule(settings))
        session.attach(patched, patch)
        install_block_replacements(patched, patch)
        hand_options_to_blocks(patched, diffusion_model)  # Wan S2V on 0.3.75: its blocks get no options
        return done(patched, tome_dit_info(settings, target, patch), title, warnings)
