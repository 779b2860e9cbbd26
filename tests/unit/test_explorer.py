"""The explorer page in a real headless browser (Debian's chromium): it draws the memory bars,
the step-time bars, the rank grid and the table, and its controls switch scenarios.

The page is written once for a small search (llama2-7b on 8 H100). The controls are driven
through the URL fragment, which goes through the same update path as the select boxes.
Skipped when chromium is not installed (README: `apt-get install chromium`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest

from dsforge.cost.profile import default_profile
from dsforge.recipe.loader import build_recipe
from dsforge.search.explorer import write_explorer
from dsforge.search.search import search
from dsforge.search.space import Space

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)")

# The page's colours for parameters (memory bars) and the first pipeline stage (grid).
PARAMS_RGB = (0x4e, 0x79, 0xa7)
OPTIMIZER_RGB = (0xe1, 0x57, 0x59)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    base = build_recipe({"name": "s", "model": {"preset": "llama2-7b"},
                         "train": {"seq_len": 4096, "steps": 10, "lr": 3e-4}})
    result = search(base, Space(gpus=8, gpus_per_node=8, global_batch=64, gpu="h100"),
                    default_profile("h100"))
    return write_explorer(base, result, tmp_path_factory.mktemp("explorer") / "explorer.html"), result


def _chromium(*args: str, timeout: float = 60) -> str:
    """Run headless chromium in its own process group; the group is killed on timeout."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--user-data-dir=" + os.environ.get("TMPDIR", "/tmp") + f"/chromium-{os.getpid()}",
               "--virtual-time-budget=3000", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out


def _dom(path, fragment: str = "") -> str:
    return _chromium("--dump-dom", f"file://{path}{fragment}")


def _screenshot(path, out, fragment: str = "") -> np.ndarray:
    import matplotlib.image

    _chromium("--window-size=1300,1300", f"--screenshot={out}", f"file://{path}{fragment}")
    return (matplotlib.image.imread(out)[..., :3] * 255).round().astype(int)


def _pixels(image: np.ndarray, rgb) -> int:
    return int(np.all(np.abs(image - np.array(rgb)) <= 2, axis=-1).sum())


def _cells(dom: str) -> int:
    return len(re.findall(r'<rect class="gpu" x="\d', dom))  # drawn cells, not the script's template


def test_page_is_self_contained(page):
    html = page[0].read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", html), "the page must not load anything"
    assert "<script src" not in html and "<link" not in html


def test_page_draws_everything(page):
    path, result = page
    dom = _dom(path)
    assert dom.count('class="part-params"') >= 2  # stacked memory bars of several candidates
    assert 'class="part-compute"' in dom  # step-time bars
    assert _cells(dom) == 8  # one cell per rank
    assert "usable" in dom and "why above the next" in dom
    best = result.ranked[0].resolved.layout
    assert f"<td>{best.tp}</td><td>{best.pp}</td>" in dom.split('class="candidate chosen"')[1][:200]


def test_controls_switch_scenarios(page):
    path, _ = page
    dom = _dom(path, "#model=llama2-7b&gpus=16&zero=3")
    assert "on 16 x NVIDIA H100" in dom and "showing ZeRO-3 only" in dom
    assert _cells(dom) == 16
    rows = re.findall(r'<tr class="candidate[^"]*" data-index="\d+">(.*?)</tr>', dom)
    assert rows and all(re.findall(r"<td>(\d+)</td>", row)[7] == "3" for row in rows)  # ZeRO column
    other = _dom(path, "#model=llama3-70b&gpus=8&zero=best")
    assert "llama3-70b on 8 x NVIDIA H100" in other


def test_screenshot_shows_the_bars(page, tmp_path):
    path, _ = page
    image = _screenshot(path, tmp_path / "best.png")
    assert image.shape[0] >= 1000 and image.shape[1] >= 1200
    assert _pixels(image, PARAMS_RGB) > 2000 and _pixels(image, OPTIMIZER_RGB) > 2000
    zero3 = _screenshot(path, tmp_path / "zero3.png", "#model=llama2-7b&gpus=8&zero=3")
    # ZeRO-3 shards the optimizer state: less of its colour in the memory bars
    assert _pixels(zero3, OPTIMIZER_RGB) < _pixels(image, OPTIMIZER_RGB)
