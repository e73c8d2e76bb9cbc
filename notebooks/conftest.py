"""nbval settings for the chapters: which outputs are compared.

Text is compared exactly (cells print rounded, seeded numbers). Figures, HTML and
widget views are not: they are checked by the tests of zerolearn.widgets and by
eye in the built book. Cells whose output holds timings carry the ``nbval-ignore-output`` tag.
The scripts a chapter writes beside itself are removed before it runs, so that ``%%writefile``
says "Writing" on every run, as it did when the chapter was stored.
"""

from pathlib import Path

WRITTEN_BY_CHAPTERS = ("allreduce.py", "my_zero.py")  # as notebooks/build.py removes them before a build


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        for name in WRITTEN_BY_CHAPTERS:  # the chapter writes them fresh, as its stored run did
            Path(str(collector.fspath)).with_name(name).unlink(missing_ok=True)
        collector.skip_compare += ("image/png", "image/svg+xml", "text/html", "stderr",
                                   "application/vnd.jupyter.widget-view+json")
