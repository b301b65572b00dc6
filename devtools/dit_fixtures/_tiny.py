"""Helpers the fixture modules share (no fixtures of its own)."""

from __future__ import annotations

FIXTURES = {}


def keep_tiny(config_name: str):
    """A ``build`` for a host config whose unet_extra_config (the real widths) would override the
    tiny unet_config detection reports: the config with the tiny fields put back."""

    def build(config):
        import comfy.supported_models

        found = getattr(comfy.supported_models, config_name)(config)
        found.unet_config.update(config)
        return found

    return build
