"""Write ``locales/en/`` from the nodes' declarations, the WebUI extension's translation files
(``localizations/``) from the translations, and check (or stamp) the translations.

    python3 devtools/make_locales.py                 # write locales/en/*.json, check every language
    python3 devtools/make_locales.py --stamp zh ja   # after translating: record which English each
                                                     # text of these languages was made from
    python3 devtools/make_locales.py --check         # only check; exit 1 if something is wrong
    python3 devtools/make_locales.py --stamp-help zh # after translating the help pages (js/docs/<node>/<lang>.md)
                                                     # from today's English pages (js/docs/<node>.md)

A translator edits ``locales/<lang>/{nodeDefs,settings,main,forge}.json`` by hand, then stamps
the language (and runs this again: ``localizations/`` follows). The tests run the same check: a text added, removed or changed in English without the
translations following fails them, naming the key. The help pages are tracked the same way, one
digest per page: a changed English page names each translated page made from an older one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    import host  # devtools/host.py: the core imports torch, which the host's Python has

    host.run_inside_host(__file__)

from tokenreduce import locales  # noqa: E402
from tokenreduce_forge import localization  # noqa: E402

LOCALES = REPO / "locales"
HELP = REPO / "js" / "docs"  # the help pages: <node>.md in English, <node>/<lang>.md translated
WEBUI = REPO / "localizations"  # the WebUI's (Forge's) translation files of the extension
TABLES = (*locales.TABLES, "forge")  # forge.json: the accordion's own words (tokenreduce_forge/texts.py)


def english() -> dict:
    return {**locales.english(), "forge": localization.english()}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def tables_of(lang: str) -> dict:
    return {name: read_json(LOCALES / lang / f"{name}.json") for name in TABLES}


def problems(lang: str) -> list[str]:
    return (locales.stale_or_missing(lang, tables_of(lang), read_json(LOCALES / lang / f"{locales.DIGESTS}.json"),
                                     english())
            + (locales.stale_help_pages(lang, read_json(LOCALES / lang / f"{locales.HELP_DIGESTS}.json"),
                                        english_help_pages()) if lang != "en" else []))


def english_help_pages() -> dict[str, str]:
    """Node id -> its English help page (``js/docs/<node>.md``, the one translations are made from)."""
    return {page.stem: page.read_text(encoding="utf-8") for page in sorted(HELP.glob("*.md"))}


def stamp_help(lang: str) -> None:
    """Record that the language's help pages are translated from today's English pages."""
    write_json(LOCALES / lang / f"{locales.HELP_DIGESTS}.json",
               {node: locales.digest(text) for node, text in english_help_pages().items()})


def webui_tables() -> dict[str, dict]:
    """``localizations/<name>.json`` of each translated language: English text -> translation."""
    return {name: localization.table(tables_of(lang)["nodeDefs"], tables_of(lang)["forge"])
            for lang, name in localization.FILES.items()}


def write_english() -> None:
    source = english()
    for name, table in source.items():
        write_json(LOCALES / "en" / f"{name}.json", table)
    write_json(LOCALES / "en" / f"{locales.DIGESTS}.json", locales.digests_of(source))


def write_webui() -> None:
    for name, table in webui_tables().items():
        write_json(WEBUI / f"{name}.json", table)


def stamp(lang: str) -> None:
    """Record, for each text the language translates, the digest of today's English of it."""
    source = locales.flat(english())
    theirs = locales.flat(tables_of(lang))
    write_json(LOCALES / lang / f"{locales.DIGESTS}.json",
               {key: locales.digest(source[key]) for key in sorted(theirs) if key in source})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    parser.add_argument("--stamp", nargs="+", default=[], metavar="LANG", help="languages whose translations are done")
    parser.add_argument("--stamp-help", nargs="+", default=[], metavar="LANG",
                        help="languages whose help pages are translated from today's English pages")
    args = parser.parse_args()
    if not args.check:
        write_english()
    for lang in args.stamp:
        stamp(lang)
    for lang in args.stamp_help:
        stamp_help(lang)
    found = [line for lang in locales.LANGUAGES for line in problems(lang)]
    if not args.check and not found:
        write_webui()
    print("\n".join(found) or f"locales: {', '.join(locales.LANGUAGES)} complete and current")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
