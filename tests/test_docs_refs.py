"""Every design reference in the project points at a page the repository holds."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_PATH = re.compile(r"\bdocs/[\w.-]+\.md\b")


def project_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    kinds = (".py", ".md", ".proto", ".yaml", ".tpl", ".toml")
    return [ROOT / n for n in names if n.endswith(kinds) and (ROOT / n).exists()
            and n != "tests/test_docs_refs.py"]


def test_no_reference_to_a_design_document_outside_the_repository():
    bad = [str(p.relative_to(ROOT)) for p in project_files() if "DESIGN.md" in p.read_text()]
    assert not bad, f"cite a page under docs/ instead of DESIGN.md: {bad}"


def test_every_docs_page_cited_exists():
    missing = sorted({f"{p.relative_to(ROOT)} cites {ref}" for p in project_files()
                      for ref in DOCS_PATH.findall(p.read_text()) if not (ROOT / ref).exists()})
    assert not missing, "\n".join(missing)
