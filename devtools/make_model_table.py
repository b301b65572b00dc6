"""Write ``docs/models.md``, the table of every model config ComfyUI ships and what the pack does
with it, from the registry itself: the DiT families (``tokenreduce/families/``), the UNets the
UNet path patches and the refusals with their reasons (``tokenreduce/families/refusals.py``).

    python3 devtools/make_model_table.py            # rewrite docs/models.md
    python3 devtools/make_model_table.py --check    # exit 1 if docs/models.md is not current

The tests run the check, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__" and "--help" not in sys.argv and "-h" not in sys.argv:
    import host  # devtools/host.py: the core imports torch, which the host's Python has

    host.run_inside_host(__file__)

PAGE = REPO / "docs" / "models.md"

HEAD = """# Models: what each node does with every model ComfyUI ships

Made by `devtools/make_model_table.py` from the code (the families in `tokenreduce/families/`, the
UNets in `tokenreduce/families/unets.py`, the refusals in `tokenreduce/families/refusals.py`); `tests/test_comfy_coverage_inprocess.py`
fails for a model config of the running ComfyUI that is in none of these tables, on the pinned
0.3.75 in CI and on any newer tree with `--comfyui`. Every covered row is sampled on a tiny
random-weight model in the tests; image quality on trained weights is not measured (no trained
weights can be downloaded where the tests run). How ToDo works on DiTs: [DiT and video models](dit-and-video.md).
"""


def render() -> str:
    from tokenreduce.families import FAMILIES, REFUSED, UNETS

    lines = [HEAD, "## UNets: ToMe and ToDo", "", "| ComfyUI config | what both nodes do |", "|---|---|"]
    lines += [f"| `{config}` | {note} |" for config, note in UNETS.items()]
    lines += ["", "## DiTs: ToDo, and ToMe where it merges whole blocks", "",
              "| family | ComfyUI configs | video | keys carry rotary positions | ToMe (whole blocks) |",
              "|---|---|---|---|---|"]
    for family in FAMILIES:
        configs = ", ".join(f"`{c}`" for c in family.configs)
        merge = family.merge
        tome = ("yes" + (f"; left alone, with a warning: {merge.leaves_alone}" if merge.leaves_alone else "")
                if merge is not None else
                f"refused (use ToDo): {family.merge_refusal}" if family.merge_refusal else "refused (use ToDo)")
        lines.append(f"| {family.name} | {configs} | {'yes' if family.video else 'no'} | "
                     f"{'yes (nearest only)' if family.rope else 'no (nearest or average)'} | {tome} |")
    lines += ["", "## Refused, and why", "",
              "Both nodes refuse these with the reason below (ToMe also refuses every DiT family without "
              "\"yes\" in its ToMe column above).", "",
              "| ComfyUI config | reason |", "|---|---|"]
    lines += [f"| `{config}` | {reason} |" for config, reason in sorted(REFUSED.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that docs/models.md is current")
    args = parser.parse_args()
    text = render()
    if args.check:
        if PAGE.exists() and PAGE.read_text(encoding="utf-8") == text:
            return 0
        print(f"{PAGE} is not current: run python3 devtools/make_model_table.py", file=sys.stderr)
        return 1
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
