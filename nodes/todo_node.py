"""The ToDo patch node: MODEL -> MODEL with key/value downsampling on a clone, on UNets and DiTs."""

from __future__ import annotations

from comfy_api.latest import io

from ..tokenreduce.catalog import TODO_NODE
from ..tokenreduce.describe import header, todo_info
from ..tokenreduce.layout import DIT, UNET
from ..tokenreduce.methods import TODO, dit_method_problem, todo_level_factors, todo_select
from ..tokenreduce.preflight import dit_factor, todo_factors
from ..tokenreduce.todo_dit import ToDoDiTPatch
from ..tokenreduce.todo_patch import BY_OVERRIDE, ToDoPatch
from .common import (PatchNode, done, find_target, patched_clone, reduce_rule, refuse_or_unchanged, refuse_stacking,
                     unet_levels)
from .host import hand_options_to_blocks, install_attention_override
from .schema import validate_inputs_for


class ToDoPatchNode(PatchNode):
    TEXT = TODO_NODE
    NODE_ID = TODO_NODE.node_id
    METHOD = TODO
    validate_inputs = validate_inputs_for(TODO)

    @classmethod
    def execute(cls, model, **values) -> io.NodeOutput:
        settings = cls.settings(values)
        refuse_stacking(model, cls.NODE_ID)
        target = find_target(model, "ToDo", "level", settings.level, todo_select(settings), kinds=(UNET, DIT))
        if target.sites is None:
            return refuse_or_unchanged(model, cls.NODE_ID, target)
        if target.layout.kind == DIT:
            return cls._patch_dit(model, settings, target)

        named = todo_level_factors(target.level, settings)
        title = header("ToDo", target)
        patched, session = patched_clone(model, cls.NODE_ID, settings, title, cls.graph_node(),
                                         preflight=todo_factors(cls.NODE_ID, [nf for nf in named
                                                                              if nf[1] in target.levels]))
        patch = ToDoPatch({level: factor for _, level, factor in named}, settings.method, session.context_key,
                          cls.NODE_ID, unet_levels(model, target), reduce_rule(settings), window=BY_OVERRIDE)
        session.attach(patched, patch)
        patched.set_model_attn1_patch(patch.attn1)
        if patch.may_window:  # the window runs the self-attention the attn1 patch marks (todo_patch.py)
            install_attention_override(patched, patch)
        info, warnings = todo_info(settings, target)
        return done(patched, info, title, warnings)

    @classmethod
    def _patch_dit(cls, model, settings, target) -> io.NodeOutput:
        family = target.layout.family
        problem = dit_method_problem(cls.NODE_ID, family, settings.method)
        if problem:
            raise ValueError(problem)
        title = header("ToDo", target)
        diffusion_model = model.get_model_object("diffusion_model")
        patch_size = family.patch(diffusion_model)
        patched, session = patched_clone(model, cls.NODE_ID, settings, title, cls.graph_node(),
                                         preflight=dit_factor(cls.NODE_ID, patch_size, settings.factor))
        patch = ToDoDiTPatch(target.layout, frozenset(site.key[1] for site in target.sites), settings.factor,
                             settings.temporal_factor, settings.method, diffusion_model, session.context_key,
                             cls.NODE_ID, reduce_rule(settings))
        session.attach(patched, patch)
        install_attention_override(patched, patch)
        hand_options_to_blocks(patched, diffusion_model)
        info, warnings = todo_info(settings, target)
        return done(patched, info, title, warnings)
