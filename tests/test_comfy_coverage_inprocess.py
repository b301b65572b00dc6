"""Every model config the running ComfyUI ships is accounted for: a DiT family ToDo reduces
(``tokenreduce/families/``, with a tiny random model in ``devtools/random_dits.py`` or
``devtools/dit_fixtures/`` that the DiT tests sample), a UNet both nodes patch (``tokenreduce/families/unets.py``,
each with its tiny-model test), or refused with its reason (``tokenreduce/families/refusals.py``).
A config the host adds later fails here until it is one of the three. Run on the pinned 0.3.75 in
CI and on any other tree with ``--comfyui``."""

from __future__ import annotations

import sys

import random_dits


def families():
    return sys.modules["tokenreduce_pack.tokenreduce.families"]


def host_configs(comfy) -> list[str]:
    import comfy.supported_models as supported

    return [config.__name__ for config in supported.models]


def test_every_host_config_is_covered_or_refused_with_a_reason(comfy):
    registry = families()
    UNETS = registry.UNETS
    covered = {config for family in registry.FAMILIES for config in family.configs}
    unaccounted = [name for name in host_configs(comfy)
                   if name not in covered and name not in UNETS and name not in registry.REFUSED]
    assert not unaccounted, f"configs neither covered nor refused with a reason: {unaccounted}"


def test_no_config_is_in_two_places(comfy):
    registry = families()
    UNETS = registry.UNETS
    covered = [config for family in registry.FAMILIES for config in family.configs]
    assert len(covered) == len(set(covered))
    assert not set(covered) & set(registry.REFUSED) and not set(covered) & set(UNETS)
    assert not set(UNETS) & set(registry.REFUSED)
    assert all(reason.strip() for reason in registry.REFUSED.values())


def test_every_covered_config_the_host_has_has_a_tiny_model(comfy):
    registry = families()
    present = set(host_configs(comfy))
    tested = {spec.config for spec in random_dits.FAMILY_SPECS.values()}
    untested = [config for family in registry.FAMILIES for config in family.configs
                if config in present and config not in tested]
    assert not untested, f"covered configs without a tiny model in the DiT tests: {untested}"


def test_every_unet_config_has_a_tiny_model(comfy):
    import random_unets

    tested = {"SD15", "SD20", "SDXL"} | set(random_unets.CONFIGS)  # the node tests' models, then the variants
    assert not [config for config in families().UNETS if config not in tested]
