"""Tiny-model fixtures of the DiT families, one module per family group (as
``tokenreduce/families/``): each module's ``FIXTURES`` maps a variant name to a
``random_dits.Fixture``. ``random_dits`` collects them; the DiT tests run every one."""
