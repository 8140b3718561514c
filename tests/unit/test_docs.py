"""The documentation: a short README, and a site that builds strictly (no broken link,
anchor or page left out of the navigation) with references generated from the models."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trimlab import spec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text


def test_the_site_builds_strictly_with_the_spec_reference(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    out = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "spec" / "index.html").read_text()
    for key in [*spec.ExperimentSpec.model_fields, "rack.virtual.platform", "transport.deadline_ms"]:
        assert f"<code>{key}</code>" in page, key
    for key in spec.TrimProfile.model_fields:
        assert f"<code>{key}</code>" in page, key
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("analysis.notebook.load_run", "analysis.notebook.compare", "analysis.notebook.list_runs",
                 "agents.ddp_hook.TrimlabState", "agents.ddp_hook.trimlab_hook", "codec.get_codec"):
        assert f'id="trimlab.{name}"' in api, name  # from the docstrings (mkdocstrings)
