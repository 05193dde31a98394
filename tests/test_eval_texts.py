"""bench/eval_texts.py's MediaWiki cleanup: the calibration text keeps prose and link labels and
drops markup, references, templates, tables and redirects."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from eval_texts import wiki_plain_text  # noqa: E402


def test_wiki_plain_text_strips_markup() -> None:
    page = (
        "{{Infobox |name={{nested}}}}'''Albedo''' is the [[diffuse reflection|fraction]] of light"
        " a [[surface]] reflects.<ref name=a>Cite</ref><ref name=b/> See [https://example.org the site].\n"
        "{| class=table\n| cell\n|}\n[[File:Albedo.png|thumb|A picture]]\n\n\n\n== History ==\n"
        "[[Category:Physics]]Measured &amp; modelled."
    )
    xml = f"<page><text xml:space=\"preserve\">{page}</text></page><page><text>#REDIRECT [[Albedo]]</text></page>"
    out = wiki_plain_text(xml)
    assert out == (
        "Albedo is the fraction of light a surface reflects. See the site.\n\n== History ==\nMeasured & modelled."
    )
