"""Reports opened the way a reader opens them: headless Chromium (Debian's), from a
file:// URL, inside a network namespace with no network at all. No console message, and
every figure drawn with data."""

import os
import re
import shutil
import subprocess

import pytest

from tests.unit.synthrun import Synth
from trimlab.analysis import report


def browse(url: str, tmp) -> tuple[str, list[str]]:
    """The DOM after scripts ran, and the console messages (errors included)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace (CI runs as root)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (make setup installs it)")
    out = subprocess.run(["unshare", "--net", chromium, "--headless", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={tmp}/chromium-profile", "--enable-logging=stderr", "--v=0",
                          "--virtual-time-budget=30000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    # the page's own messages (Chromium's internal pages log through the same channel)
    return out.stdout, [ln for ln in out.stderr.splitlines() if ":CONSOLE" in ln and "source: file://" in ln]


def drawn(dom: str) -> dict[str, bool]:
    """Per figure div: plotly built its SVG and drew points, a line or bars with data."""
    starts = sorted((m.start(), m.group(1)) for m in re.finditer(r'<div id="(fig-[a-z-]+)"', dom))
    out = {}
    for (pos, name), (end, _) in zip(starts, starts[1:] + [(len(dom), None)]):
        seg = dom[pos:end]
        out[name] = 'class="main-svg"' in seg and bool(re.search(r'<path class="(?:point|js-line)"[^>]*\sd="M|<g class="point"><path[^>]*\sd="M', seg))
    return out


def test_the_detector_sees_console_errors(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><div id="fig-x"></div><script>throw new Error("boom")</script></body></html>')
    dom, console = browse(bad.as_uri(), tmp_path)
    assert any("boom" in ln for ln in console)
    assert drawn(dom) == {"fig-x": False}


def test_run_report_renders_offline(tmp_path):
    run = Synth(trims={(0, 0, 0, 1): 60, (2, 1, 0, 0): 60}, drops={(1, 0, 0, 2)}).write(tmp_path / "run")
    page = report.for_run(run)
    dom, console = browse(page.as_uri(), tmp_path)
    assert console == []
    assert drawn(dom) == {"fig-congestion": True, "fig-error-bits": True, "fig-error-step": True,
                          "fig-training": True, "fig-phases": True}
    assert re.search(r'<tr class="agree">', dom) and not re.search(r'<tr class="disagree">', dom)


def test_comparison_renders_offline(tmp_path):
    a = Synth(trims={(0, 0, 0, 1): 60}).write(tmp_path / "a")
    b = Synth(drops={(0, 1, 0, 0)}).write(tmp_path / "b")
    page = report.compare([a, b], tmp_path / "cmp.html")
    dom, console = browse(page.as_uri(), tmp_path)
    assert console == []
    assert drawn(dom) == {"fig-acc-trim-rate": True, "fig-overlay": True}
