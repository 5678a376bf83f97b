"""Status page rendered by headless Chromium (runs only where /usr/bin/chromium exists)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="needs /usr/bin/chromium")
def test_status_page_screenshot(tmp_path):
    out = tmp_path / "status.png"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshot_status.py"), "--tiny", "--agents", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a rendered page, not a blank one
