"""The explorers and the book in a real browser: JupyterLab and headless Chromium.

What a reader sees is checked where a reader sees it. The first test starts
JupyterLab on loopback, opens the memory explorer's notebook
(``notebooks/06a_memory_explorer.ipynb``), runs it from the menu, moves the Nd slider
and the stage selector with the keyboard and the mouse, and reads the per-GPU bytes
the page then shows: they must be the paper's formula (``zerolearn.memory``) for the
new setting. The second opens, in the same JupyterLab, a notebook of the chapters'
views (the cells chapters 2-5 show: :class:`~zerolearn.widgets.StageExplorer` for
each ZeRO stage and :class:`~zerolearn.widgets.ResidualExplorer`), moves Nd in a stage
view and Nm and the checkpoints' place in the ZeRO-R view, and reads the bytes shown:
they must be the paper's formulas, written out in the test. Then, in the same JupyterLab,
a reader's copy (chapter 2 in ``notebooks/exercises/``) runs its explorer's cell and a move
of Nd changes the bytes shown; a notebook whose outputs are what the chapters store (two
step-throughs, an explorer, a figure), opened untrusted, shows every picture with no dead
button and says to run each cell, and once the ring's cell runs its player steps; and the
executed chapters with a step-through, opened untrusted, show no broken image and no dead
player. The others build the book
from the stored notebooks (as ``make book`` does, ``-W``) and open chapter 3, the
chapters with explorers and appendix 6a from ``file://`` URLs with every network
request refused: every figure must load and the math be typeset, no page may ask the
network for anything, chapter 3's tables must be on the page, every explorer must
be shown in its chapter with a static figure under it, and every step-through player
(the schematics' animations) must move to its next frame when its button is pressed.

Screenshots go to ``artifacts/screenshots/`` (gitignored), for people to look at.

The tests skip only when Chromium (``/usr/bin/chromium``, Debian's package) or the
Python ``playwright`` package is missing; with ``ZEROLEARN_BROWSER_TESTS=require``
(set by ``.ci/run``) they fail instead. Playwright's own browser download is not
used (it needs the network): Playwright drives Debian's Chromium.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerolearn import widgets
from zerolearn.figures import formulas, schematics
from zerolearn.memory import GB, model_state_bytes, per_device_bytes

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path(os.environ.get("ZEROLEARN_CHROMIUM", "/usr/bin/chromium"))
SHOTS = ROOT / "artifacts" / "screenshots"
EXPLORER = ROOT / "notebooks" / "06a_memory_explorer.ipynb"
VIEWS = "chapter_views.ipynb"  # written by the jupyterlab fixture from VIEW_CELLS
LIVE = "live_ranks.ipynb"  # written by the jupyterlab fixture: chapter 2's cells tagged "live"
LIVE_CHAPTER = ROOT / "notebooks" / "src" / "02_zero1.py"
READER_COPY = ROOT / "notebooks" / "exercises" / "02_zero1.ipynb"  # opened and run as a reader would
PICTURES = "stored_pictures.ipynb"  # written by the jupyterlab fixture: outputs as the chapters store them
_IMPORTS = "%matplotlib inline\nfrom IPython.display import display\n\nfrom zerolearn import widgets\n" \
           "from zerolearn.figures import formulas\n\n"
# The cells of chapters 2-5 that show their stage's view, each followed by its static figure.
VIEW_CELLS = [
    _IMPORTS + "display(widgets.StageExplorer(stage=1))  # Fig 1's setting: Psi = 7.5B, Nd = 64, K = 12",
    "formulas.stage_figure(stage=1)  # the default view: DP 120 GB against ZeRO-1 31.4 GB, both 2 Psi per step",
    _IMPORTS + "display(widgets.StageExplorer(stage=2))  # Fig 1's setting: Psi = 7.5B, Nd = 64, K = 12",
    "formulas.stage_figure(stage=2)  # the default view: DP 120 GB against ZeRO-2 16.6 GB, both 2 Psi per step",
    _IMPORTS + "display(widgets.StageExplorer(stage=3))  # Fig 1's setting: Psi = 7.5B, Nd = 64, K = 12",
    "formulas.stage_figure(stage=3)  # the default view: DP 120 GB against ZeRO-3 1.9 GB; 2 Psi against 3 Psi",
    _IMPORTS + "display(widgets.ResidualExplorer())  # Sec 6.1's 100B example at Nm = 16, Nd = 64, ZeRO-2",
    "formulas.residual_figure()  # the default view: checkpoints 33.6 GB per GPU, 2.1 GB with P_a",
]
# The chapters that show each explorer, each with its static default figure in the next cell.
EXPLORER_PAGES = {"06_at_scale": ["FitSolver", "MemoryExplorer", "TradeOff", "TimelineViewer",
                                  "FragmentationSimulator"],
                  "02_zero1": ["StageExplorer"], "03_zero2": ["StageExplorer"], "04_zero3": ["StageExplorer"],
                  "05_zero_r": ["ResidualExplorer"], "08_beyond": ["BeyondExplorer"]}
# The chapters with a step-through player (a schematic's frames, matplotlib's to_jshtml): its frames.
STEP_THROUGHS = {"01_data_parallelism": 7, "02_zero1": 4, "04_zero3": 8}
TABLE_EXPLORERS = {"BeyondExplorer"}  # their view is an HTML table, no figure: the book shows that table
# Chromium on a machine with a closed network: no first-run, sync, update or
# background connections (each would be refused, many at a time), no GPU, and no
# sandbox (CI runs as root). Playwright gives every launch a fresh empty profile.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 30_000  # the longest any single wait in a page may take


def unavailable(reason: str) -> None:
    if os.environ.get("ZEROLEARN_BROWSER_TESTS") == "require":
        pytest.fail(f"{reason}, and ZEROLEARN_BROWSER_TESTS=require")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shot(page_or_locator, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / name
    page_or_locator.screenshot(path=str(path))
    return path


# ----- fixtures: Chromium, JupyterLab, the built book; each always shut down ---------
@pytest.fixture(scope="module")
def browser():
    if importlib.util.find_spec("playwright") is None:
        unavailable("the Python package playwright is not installed (pip install -e '.[dev]')")
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                                      timeout=TIMEOUT_MS)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        pw.stop()


@contextlib.contextmanager
def opened(browser, name: str, width: int = 1400, height: int = 1000) -> Iterator:
    """``(page, errors)``: a page in a fresh context, closed afterwards; every wait in it times out.

    ``errors`` collects the page's uncaught JavaScript errors. On a failure the page is
    saved as ``artifacts/screenshots/FAILED-<name>.png`` and its errors printed.
    """
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            yield page, errors
        except BaseException:
            with contextlib.suppress(Exception):
                shot(page, f"FAILED-{name}.png")
            print(f"JavaScript errors on the page: {errors}")
            raise
    finally:
        context.close()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def _descendants(pid: int) -> list:
    try:
        import psutil
        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing or the process gone: nothing more to find
        return []


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab on 127.0.0.1, a free port and a random token, over a copy of the notebook
    and the notebook of the chapters' views (:data:`VIEW_CELLS`).

    The copy (outputs cleared, so every widget on the page comes from the run) keeps
    the repository's notebook unchanged by JupyterLab's autosave. Settings, workspaces
    and runtime files go to the temporary folder too. Yields ``(base_url, token)``.
    """
    import nbformat

    home = tmp_path_factory.mktemp("jupyterlab")
    root = home / "notebooks"
    root.mkdir()
    nb = nbformat.read(EXPLORER, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, root / EXPLORER.name)
    views = nbformat.v4.new_notebook(metadata={"kernelspec": nb.metadata.kernelspec})
    views.cells = [nbformat.v4.new_code_cell(source) for source in VIEW_CELLS]
    nbformat.write(views, root / VIEWS)
    live = nbformat.v4.new_notebook(metadata={"kernelspec": nb.metadata.kernelspec})
    live.cells = [nbformat.v4.new_code_cell(source) for source in live_cells()]
    nbformat.write(live, root / LIVE)
    (root / "exercises").mkdir()
    shutil.copy(READER_COPY, root / "exercises" / READER_COPY.name)
    (root / "stored").mkdir()
    for chapter in STEP_THROUGHS:  # the executed chapters, outputs as stored
        shutil.copy(ROOT / "notebooks" / f"{chapter}.ipynb", root / "stored" / f"{chapter}.ipynb")
    nbformat.write(pictures_notebook(nb.metadata.kernelspec), root / PICTURES)

    # No "get notified about Jupyter news?" pop-up over the page.
    news = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    # Every cell drawn, in view or not, so a test can look at every output of a long notebook.
    notebook = home / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    notebook.parent.mkdir(parents=True)
    notebook.write_text(json.dumps({"windowingMode": "none"}))

    port, token = free_port(), secrets.token_hex(16)
    # A data folder of its own: no notebook signature recorded, so every stored notebook opens untrusted.
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
           "jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly",
           "--ServerApp.terminals_enabled=False", "--allow-root"]
    log = (home / "jupyterlab.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {proc.returncode}: "
                                   f"{(home / 'jupyterlab.log').read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                json.loads(_get(f"{base}/api/status?token={token}"))
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab not up in 90 s: {(home / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        kernels = _descendants(proc.pid)  # the kernels run in sessions of their own: find them now
        with contextlib.suppress(Exception):  # the server shuts its kernels down, then itself
            request = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(request, timeout=10).close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for child in kernels:
            with contextlib.suppress(Exception):
                child.kill()
        log.close()


BOOK_STAMP = ROOT / "book" / "_build" / "html" / ".built-with-W"
"""Written by ``make book`` after a build that passed with warnings as errors."""


def book_is_fresh() -> bool:
    """True when :data:`BOOK_STAMP` is newer than every file git tracks outside ``tests/`` and
    ``zerolearn/`` (the book shows the stored notebooks; it runs no code of the package)."""
    if not BOOK_STAMP.exists():
        return False
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        return False
    files = [ROOT / name for name in listed.stdout.decode().split("\0")
             if name and not name.startswith(("tests/", "zerolearn/"))]
    newest = max((f.stat().st_mtime for f in files if f.exists()), default=float("inf"))
    return len(files) > 0 and BOOK_STAMP.stat().st_mtime > newest


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> Path:
    """The book built as ``make book`` builds it (``-W``), from the stored notebooks: ``make book``'s
    own build where it is newer than every file of the repository it could be built from (its
    stamp, :data:`BOOK_STAMP`, is written only when the build passed with ``-W``; ``.ci/run``
    builds the book before the tests), else a new build into a temporary folder."""
    if book_is_fresh():
        return BOOK_STAMP.parent
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    if not jb.exists():
        pytest.fail(f"jupyter-book is not installed beside {sys.executable}")
    done = subprocess.run([str(jb), "build", ".", "--config", "book/_config.yml", "--toc", "book/_toc.yml",
                           "--path-output", str(out), "-W", "--keep-going"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out / "_build" / "html"


# ----- the memory explorer, live ---------------------------------------------------------
def wait_for_kernel(base: str, token: str, timeout: float = TIMEOUT_MS / 1000) -> None:
    """Until the page's kernel has started, is idle and has the page connected (asked of the server).

    The notebook's own status indicator says "idle" before the kernel is connected,
    and cells run from the menu before then are dropped.
    """
    deadline, kernels = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            kernels = json.loads(_get(f"{base}/api/kernels?token={token}"))
        except urllib.error.HTTPError as e:  # the server lists kernels while one starts: a 500 now and then
            if e.code < 500:
                raise
            kernels = f"HTTP {e.code}"
        else:
            if any(k["execution_state"] == "idle" and k["connections"] > 0 for k in kernels):
                return
        time.sleep(0.25)
    raise TimeoutError(f"no idle, connected kernel in {timeout} s: {kernels}")


def run_all_cells(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


def summary_bytes(page) -> float:
    """The bytes per GPU the explorer's sentence shows for the selected stage, in bytes."""
    text = page.locator(".widget-html-content", has_text="per device of").inner_text()
    match = re.search(r"needs ([\d,.]+) GB per device", text)
    assert match, text
    return float(match.group(1).replace(",", "")) * GB


def test_memory_explorer_in_jupyterlab_shows_the_formula_for_the_new_setting(browser, jupyterlab):
    base, token = jupyterlab
    with opened(browser, "explorer", height=1300) as (page, errors):
        page.goto(f"{base}/lab/tree/{EXPLORER.name}?token={token}")
        page.locator(".jp-Notebook").wait_for()
        wait_for_kernel(base, token)
        run_all_cells(page)

        summary = page.locator(".widget-html-content", has_text="per device of")
        summary.wait_for()
        default = model_state_bytes(7.5e9, 64, 3)["total"]  # Fig 1: 16 x 7.5e9 / 64 = 1.875e9 bytes
        assert summary_bytes(page) == pytest.approx(default, abs=0.005 * GB)
        # Drawing the Psi slider must not move Psi (a slider snapping 7.5e9 to its step grid did).
        assert "120.00 GB" in summary.locator("tr", has_text="0 DP").inner_text()  # 16 x 7.5e9 bytes
        explorer = page.locator(".jp-OutputArea-output .widget-vbox").first
        explorer.scroll_into_view_if_needed()
        shot(page, "explorer_default.png")
        figure = explorer.locator("img").first
        before = figure.get_attribute("src")

        # Nd: 64 -> 256, two steps right on the slider's handle (the keyboard a reader would use).
        nd = page.locator(".widget-slider", has=page.get_by_text("Nd (data parallel)", exact=True))
        nd.locator(".noUi-handle").click()
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        nd.locator(".widget-readout").filter(has_text=re.compile(r"^256$")).wait_for()
        # Stage: the dropdown, 3 -> 2.
        stage = page.locator(".widget-dropdown", has=page.get_by_text("stage", exact=True)).locator("select")
        stage.select_option(label="2 P_os+g")

        expected = model_state_bytes(7.5e9, 256, 2)["total"]  # 2 x 7.5e9 + 14 x 7.5e9 / 256 = 15.41e9
        assert expected == per_device_bytes(7.5e9, 256, 2)["total"]
        shown = f"needs {expected / GB:,.2f} GB per device"
        page.locator(".widget-html-content", has_text=shown).wait_for()
        assert summary_bytes(page) == pytest.approx(expected, abs=0.005 * GB)
        # The sentence, the table row of the stage and the figure all follow the controls.
        row = summary.locator("tr", has_text="2 P_os+g").first
        assert f"{expected / GB:,.2f} GB" in row.inner_text()
        # The explorer sends the figure before the summary, so the figure is new too.
        assert figure.get_attribute("src") != before
        page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=figure.element_handle())
        explorer.scroll_into_view_if_needed()
        shot(page, "explorer_nd256_stage2.png")
        shot(explorer, "explorer_widget.png")
        # No widget view failed to draw (ipywidgets shows those as an error box), and no
        # uncaught error came from the widgets (JupyterLab's own are not ours to judge).
        assert page.get_by_text("Click to show javascript error").count() == 0
        assert not [e for e in errors if "widget" in e.lower()], errors


# ----- the chapters' views, live ---------------------------------------------------------
def shown_gb(view, pattern: str) -> float:
    """The number of GB that ``pattern`` (a regex with one group) finds in a view's text, in bytes."""
    text = view.text_content()
    match = re.search(pattern, text)
    assert match, text
    return float(match.group(1).replace(",", "")) * GB


def move_slider(view, page, label: str, steps: int, readout: str) -> None:
    """Move the slider labelled ``label`` in ``view`` by ``steps`` with the arrow keys, until it reads ``readout``."""
    slider = view.locator(".widget-slider", has=page.get_by_text(label, exact=True))
    slider.locator(".noUi-handle").click()
    for _ in range(steps):
        page.keyboard.press("ArrowRight")
    slider.locator(".widget-readout").filter(has_text=re.compile(f"^{readout}$")).wait_for()


def test_chapter_views_in_jupyterlab_show_each_stages_formula(browser, jupyterlab):
    base, token = jupyterlab
    psi = 7.5e9
    with opened(browser, "chapter_views", height=1300) as (page, errors):
        # A workspace of its own: only this notebook opens, whatever the other tests left open.
        page.goto(f"{base}/lab/workspaces/views/tree/{VIEWS}?token={token}")
        page.locator(".jp-Notebook").wait_for()
        wait_for_kernel(base, token)
        run_all_cells(page)

        views = page.locator(".jp-OutputArea-output .widget-vbox")
        stage_views = {s: views.filter(has_text=f"ZeRO-{s} (P_os") for s in (1, 2, 3)}
        residual = views.filter(has_text="Activation checkpoints:")
        residual.locator(".widget-html-content", has_text="on each GPU").wait_for()
        # Fig 1 (Psi = 7.5B, Nd = 64, K = 12): DP 16 Psi = 120 GB; ZeRO-1 4 Psi + 12 Psi / 64,
        # ZeRO-2 2 Psi + 14 Psi / 64, ZeRO-3 16 Psi / 64: 31.4, 16.6 and 1.9 GB.
        fig1 = {1: 4 * psi + 12 * psi / 64, 2: 2 * psi + 14 * psi / 64, 3: 16 * psi / 64}
        for stage, expected in fig1.items():
            view = stage_views[stage]
            view.locator(".widget-html-content", has_text="per device against DP's").wait_for()
            assert shown_gb(view, r"holds ([\d,.]+) GB per device") == pytest.approx(expected, abs=0.005 * GB)
            assert shown_gb(view, r"against DP's ([\d,.]+) GB") == 16 * psi
        assert "3 Psi = 45.00 GB per step" in stage_views[3].text_content()  # Sec 7.2.2: 3 Psi of 2 bytes
        shot(stage_views[2], "stage_view_default.png")

        # ZeRO-2, Nd 64 -> 256: 2 Psi + (2 + 12) Psi / 256 = 15.41e9 bytes; gradients 2 Psi / 256.
        view = stage_views[2]
        view.scroll_into_view_if_needed()
        move_slider(view, page, "Nd (data parallel)", 2, "256")
        expected = 2 * psi + 14 * psi / 256
        view.locator(".widget-html-content", has_text=f"holds {expected / GB:,.2f} GB per device").wait_for()
        grads = view.locator("tr", has_text="grads").text_content()
        assert f"{2 * psi / 256 / GB:,.2f} GB" in grads and f"{2 * psi / GB:,.2f} GB" in grads  # ZeRO-2 and DP
        shot(view, "stage_view_nd256.png")

        # ZeRO-R, Sec 6.1's 100B example: 16 x 1024 x 8192 x 125 two-byte values of checkpoint per GPU
        # (33.6 GB), P_a divides it by Nm = 16; Nm 16 -> 64 divides it by 64; P_a+cpu leaves none.
        checkpoint = 16 * 1024 * 8192 * 125 * 2
        residual.scroll_into_view_if_needed()
        on_gpu = r"Activation checkpoints: ([\d,.]+) GB on each GPU"
        assert shown_gb(residual, on_gpu) == pytest.approx(checkpoint / 16, abs=0.005 * GB)
        shot(residual, "residual_view_default.png")
        move_slider(residual, page, "Nm (model parallel)", 2, "64")
        residual.locator(".widget-html-content", has_text=f"{checkpoint / 64 / GB:,.2f} GB on each GPU").wait_for()
        assert shown_gb(residual, on_gpu) == pytest.approx(checkpoint / 64, abs=0.005 * GB)
        where = residual.locator(".widget-dropdown", has=page.get_by_text("checkpoints", exact=True)).locator("select")
        where.select_option(label="P_a+cpu: on the CPU")
        residual.locator(".widget-html-content", has_text="0.00 GB on each GPU").wait_for()
        assert shown_gb(residual, r"([\d,.]+) GB in host memory") == pytest.approx(checkpoint / 64, abs=0.005 * GB)
        shot(residual, "residual_view_nm64_cpu.png")
        assert page.get_by_text("Click to show javascript error").count() == 0
        assert not [e for e in errors if "widget" in e.lower()], errors


def live_cells() -> list[str]:
    """Chapter 2's persistent-ranks cells (tagged ``live`` in its source), in order."""
    sys.path.insert(0, str(ROOT / "notebooks"))
    import build  # notebooks/build.py

    cells = [c.source for c in build.read_source(LIVE_CHAPTER).cells if "live" in c.metadata.get("tags", [])]
    assert any(c.startswith("%%ranks") for c in cells), f"{LIVE_CHAPTER.name} has no %%ranks cell tagged live"
    return cells


def test_persistent_ranks_keep_a_tensor_from_cell_to_cell_in_jupyterlab(browser, jupyterlab):
    # Chapter 2's cells: each of 3 ranks builds (r + 1) * [1..7] padded to 9 in one cell,
    # reduce-scatters it in the next (rank r gets slice r of the sum 6 * [1..7]), and
    # updates and all-gathers its slice in the third: state kept between cells.
    base, token = jupyterlab
    total = [6.0 * i for i in range(1, 8)] + [0.0, 0.0]
    with opened(browser, "live_ranks", height=1300) as (page, errors):
        page.goto(f"{base}/lab/workspaces/live/tree/{LIVE}?token={token}")
        page.locator(".jp-Notebook").wait_for()
        wait_for_kernel(base, token)
        run_all_cells(page)
        outputs = page.locator(".jp-OutputArea-output")
        for rank in range(3):
            outputs.filter(has_text=f"[rank {rank}] {total[3 * rank:3 * rank + 3]}").first.wait_for()
        updated = [v - 0.5 for v in total]
        outputs.filter(has_text=f"[rank 2] {updated[:7]}").first.wait_for()
        shot(page, "live_ranks.png")
        assert page.get_by_text("CellError").count() == 0
        assert not errors, errors


# ----- a reader's copy, and stored outputs opened untrusted --------------------------------
PICTURE_CELLS = [  # (source, its output as the chapters store it): two step-throughs, an explorer, a figure
    ("from IPython.display import HTML\nfrom zerolearn.figures import schematics\n\n"
     "HTML(schematics.ring_animation(3).html)", lambda: _html(schematics.ring_animation(3).html)),
    ("HTML(schematics.zero1_animation(nd=3).html)", lambda: _html(schematics.zero1_animation(nd=3).html)),
    (_IMPORTS + "display(widgets.StageExplorer(stage=1))", lambda: widgets.StageExplorer(stage=1)._repr_mimebundle_()),
    ("formulas.stage_figure(stage=1)", lambda: _png(formulas.stage_figure(stage=1))),
]


def _html(html: str) -> dict:
    return {"text/html": html, "text/plain": "<IPython.core.display.HTML object>"}


def _png(fig) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": "<Figure>"}


def pictures_notebook(kernelspec):
    """A notebook whose outputs are what the chapters store, made by the package's current code:
    two step-throughs, an explorer and a figure, with no signature (it opens untrusted)."""
    import nbformat

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": kernelspec})
    for n, (source, output) in enumerate(PICTURE_CELLS, start=1):
        cell = nbformat.v4.new_code_cell(source, execution_count=n)
        cell.outputs = [nbformat.v4.new_output("display_data", data=output())]
        nb.cells.append(cell)
    return nb


def open_untrusted(page, base: str, token: str, path: str, workspace: str) -> list[dict]:
    """Open ``path`` (never trusted here) in a workspace of its own, wait for every output image.

    Returns every image of the outputs: its ``src`` (cut short) and its natural width.
    """
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{path}?token={token}")
    page.locator(".jp-Notebook .jp-OutputArea-output").first.wait_for()
    page.wait_for_function("() => Array.from(document.querySelectorAll('.jp-OutputArea-output img'))"
                           ".every(i => i.complete)")
    return page.eval_on_selector_all(
        ".jp-OutputArea-output img", "imgs => imgs.map(i => ({src: (i.getAttribute('src') || '').slice(0, 40),"
                                     " w: i.naturalWidth}))")


def test_a_readers_copy_runs_its_explorer_in_jupyterlab(browser, jupyterlab):
    # Chapter 2 as the reader has it: run the explorer's cell, move Nd, and the bytes shown follow
    # the paper's formula for ZeRO-1: 4 Psi + 12 Psi / Nd (Fig 1).
    base, token = jupyterlab
    psi = 7.5e9
    with opened(browser, "readers_copy", height=1300) as (page, errors):
        page.goto(f"{base}/lab/workspaces/reader/tree/exercises/{READER_COPY.name}?token={token}")
        page.locator(".jp-Notebook").wait_for()
        wait_for_kernel(base, token)
        cell = page.locator(".jp-CodeCell", has_text="widgets.StageExplorer(stage=1)").first
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        view = cell.locator(".jp-OutputArea-output .widget-vbox")
        summary = view.locator(".widget-html-content", has_text="per device against DP's")
        summary.wait_for()
        before = shown_gb(view, r"holds ([\d,.]+) GB per device")
        assert before == pytest.approx(4 * psi + 12 * psi / 64, abs=0.005 * GB)
        figure = view.locator("img").first
        src = figure.get_attribute("src")
        move_slider(view, page, "Nd (data parallel)", 2, "256")
        expected = 4 * psi + 12 * psi / 256
        view.locator(".widget-html-content", has_text=f"holds {expected / GB:,.2f} GB per device").wait_for()
        assert figure.get_attribute("src") != src  # the figure follows the slider too
        page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=figure.element_handle())
        shot(view, "readers_copy_explorer_nd256.png")
        assert page.get_by_text("Click to show javascript error").count() == 0
        assert not [e for e in errors if "widget" in e.lower()], errors


def test_stored_pictures_show_untrusted_and_play_once_run(browser, jupyterlab):
    from zerolearn.figures.animate import STORED_NOTE
    from zerolearn.widgets.base import STORED_NOTE as EXPLORER_NOTE

    base, token = jupyterlab
    with opened(browser, "stored_pictures", height=1300) as (page, errors):
        images = open_untrusted(page, base, token, PICTURES, "pictures")
        # Two step-throughs (each its first frame) and one figure; the explorer is text.
        assert len(images) == 3 and all(i["w"] > 0 for i in images), images
        outputs = page.locator(".jp-OutputArea-output")
        assert outputs.locator(".anim-controls:visible").count() == 0  # no dead buttons
        for frames in (5, 4):
            outputs.get_by_text(STORED_NOTE.format(n=frames)).wait_for()
        outputs.get_by_text(EXPLORER_NOTE).wait_for()
        shot(page, "stored_pictures_untrusted.png")

        # Run the ring's cell: its output is the reader's own now, so its script runs: the
        # note goes, the controls show and step to the next frame.
        wait_for_kernel(base, token)
        cell = page.locator(".jp-CodeCell", has_text="ring_animation(3)").first
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        player = cell.locator(".jp-OutputArea-output div.animation")
        controls = player.locator(".anim-controls")
        controls.wait_for(state="visible")
        assert cell.get_by_text(STORED_NOTE.format(n=5)).count() == 0
        frame = player.locator("img").first
        before = frame.get_attribute("src")
        controls.locator('button[title="Next frame"]').click()
        page.wait_for_function("([i, s]) => i.getAttribute('src') !== s && i.complete && i.naturalWidth > 0",
                               arg=[frame.element_handle(), before])
        shot(cell, "stored_pictures_ring_run.png")
        assert not [e for e in errors if "anim" in e.lower()], errors


@pytest.mark.parametrize("chapter", list(STEP_THROUGHS))
def test_executed_chapter_opened_untrusted_shows_every_picture(browser, jupyterlab, chapter):
    base, token = jupyterlab
    with opened(browser, f"untrusted_{chapter}", height=1300) as (page, errors):
        images = open_untrusted(page, base, token, f"stored/{chapter}.ipynb", f"untrusted-{chapter}")
        assert images and not [i for i in images if i["w"] == 0], f"broken images: {images}"
        outputs = page.locator(".jp-OutputArea-output")
        assert outputs.locator(".anim-controls:visible").count() == 0, "a step-through's buttons shown dead"
        player = outputs.locator("div.animation").first
        player.scroll_into_view_if_needed()
        shot(player, f"untrusted_{chapter}_player.png")


# ----- the built book ----------------------------------------------------------------------
def offline(page) -> list[str]:
    """Refuse every request off the machine, as a reader without a network would see it.

    Returns the list of refused URLs, which stays empty for a book that needs no
    network (MathJax comes from sphinx-mathjax-offline, widgets are not embedded).
    """
    refused: list[str] = []

    def refuse(route) -> None:
        refused.append(route.request.url)
        route.abort()

    page.route(re.compile(r"^https?://"), refuse)
    return refused


def book_errors(errors: list[str]) -> list[str]:
    """The page's JavaScript errors, less one of the theme's own that every jupyter-book 1.x page has.

    sphinx-thebe (loaded by jupyter-book whether or not thebe is used) adds its inline
    ``const THEBE_JS_URL = ...`` script twice under Sphinx 7, and the second copy fails.
    """
    return [e for e in errors if "THEBE_JS_URL" not in e]


def open_page(page, path: Path) -> list[dict]:
    """Open a built page from disk; wait for its images and its math. Returns the article's images."""
    page.goto(path.as_uri())
    page.locator("article h1").first.wait_for()
    page.wait_for_function("() => Array.from(document.images).every(i => i.complete)")
    # MathJax (from the book's own _static, on pages with math) typesets after load: wait for it,
    # then no raw TeX may be left.
    if page.locator("script[src*='mathjax']").count():
        page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.document")
        page.evaluate("() => MathJax.startup.promise")
    text = page.locator("article").inner_text()
    assert "\\(" not in text and "$$" not in text, "TeX left untypeset"
    return page.eval_on_selector_all(
        "article img", "imgs => imgs.map(i => ({src: i.getAttribute('src'), w: i.naturalWidth, h: i.naturalHeight}))")


def test_book_chapter_3_shows_its_figures_and_tables(browser, book):
    with opened(browser, "book_ch03", width=1600) as (page, errors):
        refused = offline(page)
        images = open_page(page, book / "notebooks" / "03_zero2.html")
        assert "Chapter 3" in page.locator("article h1").first.inner_text()
        assert page.locator("article h1 mjx-container").count() == 1  # P_{os+g} in the title, typeset
        shot(page, "book_ch03_top.png")
        assert len(images) >= 3, images  # the bucket schedule, the gradient timeline, the peaks by version
        assert all(i["w"] > 0 and i["h"] > 0 for i in images), images
        for n, img in enumerate(page.locator("article img").all()):
            img.scroll_into_view_if_needed()
            assert img.bounding_box()["width"] > 200
            shot(img, f"book_ch03_figure{n}.png")
        # The chapter's tables are printed by its cells, measured next to the formula:
        # text tables in the outputs (zerolearn.tables.text_table: a rule of dashes under the header).
        outputs = page.locator("article .cell_output pre").all()
        rule = re.compile(r"^\s*-+(\s+-+)+\s*$")
        tables = [o for o in outputs if any(rule.match(line) for line in o.inner_text().splitlines())]
        assert len(tables) >= 4, [o.inner_text()[:200] for o in outputs]
        for t in tables:
            assert t.is_visible() and t.bounding_box()["height"] > 40
        tables[0].scroll_into_view_if_needed()
        shot(page, "book_ch03_table.png")
        assert not refused, f"the page asked the network for {refused}"
        assert not book_errors(errors), errors


def test_every_explorer_is_shown_in_a_chapter():
    assert sorted(widgets.__all__) == sorted({n for names in EXPLORER_PAGES.values() for n in names})


@pytest.mark.parametrize("chapter", list(EXPLORER_PAGES))
def test_book_shows_a_static_figure_under_every_explorer(browser, book, chapter):
    with opened(browser, f"book_{chapter}", width=1600) as (page, errors):
        refused = offline(page)
        open_page(page, book / "notebooks" / f"{chapter}.html")
        cells = page.locator("article div.cell").all()
        sources = [c.locator(".cell_input").inner_text() if c.locator(".cell_input").count() else "" for c in cells]
        for name in EXPLORER_PAGES[chapter]:
            at = [i for i, s in enumerate(sources) if f"widgets.{name}(" in s]
            assert at, f"{chapter} has no cell showing widgets.{name}"
            # Without a kernel the explorer shows as its text form (name and settings) ...
            assert f"{name}(" in cells[at[0]].locator(".cell_output").inner_text()
            if name in TABLE_EXPLORERS:  # ... and the next cell shows its default view, a table
                table = cells[at[0] + 1].locator(".cell_output table")
                assert "summary" in sources[at[0] + 1] and table.count() == 1, f"no static table after widgets.{name}"
                shot(table, f"book_{chapter}_{name}.png")
                continue
            # ... and the next cell draws its default view as a static figure.
            assert "figures." in sources[at[0] + 1] or "formulas." in sources[at[0] + 1], sources[at[0] + 1]
            img = cells[at[0] + 1].locator(".cell_output img")
            assert img.count() == 1, f"no static figure after widgets.{name}"
            img.scroll_into_view_if_needed()
            assert img.evaluate("i => i.complete ? i.naturalWidth : 0") > 0, f"the figure of {name} did not load"
            shot(img, f"book_{chapter}_{name}.png")
        assert not refused, f"the page asked the network for {refused}"
        assert not book_errors(errors), errors


def test_book_appendix_shows_the_memory_explorers_static_figure(browser, book):
    with opened(browser, "book_06a", width=1600) as (page, errors):
        refused = offline(page)
        images = open_page(page, book / "notebooks" / EXPLORER.with_suffix(".html").name)
        assert len(images) == 1 and images[0]["w"] > 0, images
        table = page.locator("article table")  # the formulas of Sec 5, typeset
        assert table.count() == 1 and table.locator("mjx-container").count() >= 8
        shot(page, "book_06a_top.png")
        assert not refused, f"the page asked the network for {refused}"
        assert not book_errors(errors), errors


@pytest.mark.parametrize("chapter", list(STEP_THROUGHS))
def test_book_step_through_moves_to_the_next_frame(browser, book, chapter):
    with opened(browser, f"book_{chapter}_player", width=1600) as (page, errors):
        refused = offline(page)
        open_page(page, book / "notebooks" / f"{chapter}.html")
        player = page.locator("article div.animation").first
        player.scroll_into_view_if_needed()
        frame, slider = player.locator("img").first, player.locator("input.anim-slider")
        assert slider.get_attribute("max") == str(STEP_THROUGHS[chapter] - 1)  # set by the player's script
        before = frame.get_attribute("src")
        assert before.startswith("data:image/png;base64,") and slider.input_value() == "0"
        forward = player.locator('button[title="Next frame"]')
        forward.locator("svg").wait_for()  # its icon, drawn by the theme's own Font Awesome
        shot(player, f"book_{chapter}_frame0.png")
        forward.click()
        assert slider.input_value() == "1"
        after = frame.get_attribute("src")
        assert after.startswith("data:image/png;base64,") and after != before, "the frame did not change"
        assert frame.evaluate("i => i.complete ? i.naturalWidth : 0") > 0
        shot(player, f"book_{chapter}_frame1.png")
        assert not refused, f"the page asked the network for {refused}"
        assert not book_errors(errors), errors
