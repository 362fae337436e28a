"""Run every ``python`` block of one Markdown page, in order, as a reader would.

    python tests/docs_pages.py docs/pytorch.md

The blocks of a page share one namespace (a later block uses what an earlier one made), in
a fresh interpreter whose ``__name__`` is ``"__main__"``. Sybil parses the page: it reads
Markdown as CommonMark does (fences, indented fences, HTML comments) and gives each block
its line, so a failure's traceback points at the page. A block may be skipped only with a
reason next to it, visible in the page's source:

    <!-- skip: next "why: where the same code runs instead" -->

The URLs in the text are the ones a reader has on their own machine; the test session
starts its servers on free ports, so the runner substitutes, in every block before it
runs (the documented substitutions; `SUBSTITUTIONS` below, with the session's values in
``$ASYNCCACHE_DOCS_URLS`` as JSON):

| in the docs                         | runs as                                |
|-------------------------------------|----------------------------------------|
| ``redis://127.0.0.1:6379/0``        | the session's redis-server             |
| ``memcached://127.0.0.1:11211``     | the session's memcached                |
| ``redis+cluster://h1:7000,h2:7001`` | the session's 3-node Redis Cluster     |
| ``start_http_server(9100)``         | ``start_http_server(0)`` (a free port) |

``$HOME`` and the working directory are a temporary directory of the test.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import unittest
from pathlib import Path

from sybil import Document, Example
from sybil.evaluators.python import pad
from sybil.parsers.markdown import CodeBlockParser, SkipParser

#: what the docs say -> the key of ``$ASYNCCACHE_DOCS_URLS`` (or a literal replacement)
SUBSTITUTIONS = {
    "redis://127.0.0.1:6379/0": "redis",
    "memcached://127.0.0.1:11211": "memcached",
    "redis+cluster://h1:7000,h2:7001": "cluster",
}
LITERAL = {"start_http_server(9100)": "start_http_server(0)"}
ENV = "ASYNCCACHE_DOCS_URLS"


def substituted(source: str, urls: dict[str, str]) -> str:
    for written, key in SUBSTITUTIONS.items():
        if written in source:
            source = source.replace(written, urls[key])
    for written, runs in LITERAL.items():
        source = source.replace(written, runs)
    return source


def main(page: str) -> int:
    urls = json.loads(os.environ.get(ENV, "{}"))

    def run(example: Example) -> None:
        source = pad(substituted(str(example.parsed), urls),
                     example.line + example.parsed.line_offset)
        exec(compile(source, page, "exec", dont_inherit=True), example.namespace)

    document = Document.parse(page, CodeBlockParser("python", run), SkipParser())
    document.namespace["__name__"] = "__main__"
    ran = skipped = 0
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest as why:
            print(f"skipped {page}:{example.line}: {why}")
            skipped += 1
            continue
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {page}:{example.line}", file=sys.stderr)
            return 1
        if isinstance(example.parsed, str):  # a code block (a directive's is a tuple)
            ran += 1
    print(f"ran {ran} blocks, skipped {skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main(str(Path(sys.argv[1]))))
