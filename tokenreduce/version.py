"""The pack's version (pyproject.toml says the same; a test checks). Part of the key of every
decision the auto rule keeps, so a new version measures again."""

VERSION = "0.2.0"
