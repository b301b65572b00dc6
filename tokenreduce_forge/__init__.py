"""TokenReduce in Stable Diffusion WebUI Forge: the glue between Forge and the host-free core.

- ``settings``: the extension's arguments, built from the methods' declared inputs; the
  settings of each pass; the infotext keys and paste rules (no host imports);
- ``grid``: the one place Forge differs for the patches (no ``activations_shape``);
- ``patching``: a pass's patched UNet clone and its run state (Forge's patcher API only);
- ``flux``: ToDo on Forge's own Flux.1, whose blocks have no override slot (object patches);
- ``hooks``: what the script does at each point of a generation;
- ``texts``: the accordion's own words; ``localization``: the WebUI's translation files of the
  accordion, made from the pack's translations (no host imports);
- ``ui``: the accordion (gradio); ``xyz``: the X/Y/Z plot axes.

The script itself is ``scripts/tokenreduce_webui.py``. ComfyUI never imports this package.
"""
