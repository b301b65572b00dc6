"""Stable Diffusion WebUI Forge entry of TokenReduce: an always-visible script with its
accordion in txt2img and img2img (``alwayson_scripts`` name "tokenreduce") and two X/Y/Z plot
axes. The WebUI runs this file by path (its module name is the file name) with the extension
root on ``sys.path``: the host-free core is ``tokenreduce``, the Forge glue
``tokenreduce_forge``."""

from modules import scripts

from tokenreduce_forge import console, hooks, ui, xyz
from tokenreduce_forge.settings import TITLE


class TokenReduceScript(scripts.Script):
    sorting_priority = 15

    def title(self):
        return TITLE

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        controls, self.infotext_fields, self.paste_field_names = ui.build(self, is_img2img)
        return controls

    def before_process(self, p, *args):
        hooks.before_process(p, args)

    def process_before_every_sampling(self, p, *args, **kwargs):
        hooks.before_sampling(p, args, kwargs)

    def postprocess_batch(self, p, *args, **kwargs):
        hooks.after_batch(p, args)


xyz.register()
console.quiet_refusals()  # a refusal's traceback only at debug level (console.py)
