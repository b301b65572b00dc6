"""The ToDo patch node: MODEL -> MODEL with key/value downsampling on a clone."""

from __future__ import annotations

from comfy_api.latest import io

from ..tokenreduce.describe import header, todo_info
from ..tokenreduce.methods import TODO, todo_level_factors
from ..tokenreduce.preflight import todo_factors
from ..tokenreduce.todo_patch import ToDoPatch
from .common import PatchNode, done, find_target, patched_clone, refuse_or_unchanged, refuse_stacking
from .schema import validate_inputs_for


class ToDoPatchNode(PatchNode):
    NODE_ID = "TokenReduceToDo"
    DISPLAY_NAME = "Token Downsampling (ToDo, TokenReduce)"
    DESCRIPTION = ("Speeds up sampling by letting self-attention read keys and values pooled on the token grid "
                   "(ToDo); every query stays. No matching, nothing to unmerge, deterministic. Works on SD1.x, "
                   "SD2.x and SDXL; reports what it patched.")
    METHOD = TODO
    validate_inputs = validate_inputs_for(TODO)

    @classmethod
    def execute(cls, model, **values) -> io.NodeOutput:
        settings = cls.settings(values)
        refuse_stacking(model, cls.NODE_ID)
        target = find_target(model, "ToDo", "level", settings.level, lambda layout, level: layout.at(
            {lv for _, lv, _ in todo_level_factors(level, settings)}))
        if target.sites is None:
            return refuse_or_unchanged(model, cls.NODE_ID, target)

        named = todo_level_factors(target.level, settings)
        title = header("ToDo", target)
        patched, session = patched_clone(model, cls.NODE_ID, settings, title, cls.graph_node(),
                                         preflight=todo_factors(cls.NODE_ID, [nf for nf in named
                                                                              if nf[1] in target.levels]))
        patch = ToDoPatch({level: factor for _, level, factor in named}, settings.method, session.context_key,
                          cls.NODE_ID)
        session.attach(patched, patch)
        patched.set_model_attn1_patch(patch.attn1)
        info, warnings = todo_info(settings, target)
        return done(patched, info, title, warnings)
