#!/usr/bin/env python
"""Write the padding-free section and the claims table that open docs/BENCHMARKS.md, the
results table of README.md and the Hanayo memory table from the benchmark JSONs in docs/ (dynapipe_ext/report/claims.py), each between
its markers; `--check` writes nothing and exits 1 naming every table that differs from what
the JSONs give, or every cited run whose JSON records no commit, date or command.

    python tools/write_claims.py [--check]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynapipe_ext.report import claims  # noqa: E402
from dynapipe_ext.report.doc_sections import replace_section  # noqa: E402

# (file, marker name, title if missing, table)
TABLES = (("docs/BENCHMARKS.md", "padding-free", "Against packing at its very best",
           claims.padding_free_section),
          ("docs/BENCHMARKS.md", "claims", "Claims", claims.claims_table),
          ("README.md", "results", "Results", claims.results_table),
          ("docs/BENCHMARKS.md", "hanayo", "Hanayo's wave: its memory beside 1F1B's and the "
           "paper's claim", claims.hanayo_table))


def load_docs(folder: Path) -> dict:
    return {name: json.loads((folder / name).read_text()) for name in claims.cited_files()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    p.add_argument("--root", default=str(ROOT), help="repository whose docs to read and write")
    args = p.parse_args(argv)
    root = Path(args.root)
    docs = load_docs(root / "docs")
    problems = [f"docs/{item}: not recorded" for item in claims.missing_provenance(docs)]
    texts = {}
    for file, name, title, table in TABLES:
        path = root / file
        old = texts.get(file, path.read_text())
        texts[file] = replace_section(old, name, title, table(docs))
    for file, new in texts.items():
        if (root / file).read_text() != new:
            if args.check:
                problems.append(f"{file}: a table differs from what the JSONs give (run "
                                f"python tools/write_claims.py)")
            else:
                (root / file).write_text(new)
                print(f"[claims] updated {file}")
    for line in problems:
        print(f"[claims] {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
