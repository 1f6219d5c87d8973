"""Regenerate docs/rules.md from the catalog (every rule's documentation, one `## DDNNN` section each, the page
SARIF's helpUri points into):

    .venv/bin/python -m ddpdoctor.dev.rules_doc

tests/test_cli_conventions.py fails while the page differs from `ddpdoctor.rules.catalog_markdown_document()`."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.rules import catalog_markdown_document

PAGE = Path(__file__).resolve().parents[2] / "docs" / "rules.md"


def main() -> int:
    PAGE.write_text(catalog_markdown_document(), encoding="utf-8")
    print(f"{PAGE}: {len(catalog_markdown_document().splitlines())} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
