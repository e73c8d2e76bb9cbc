"""nbval settings for the chapters: which outputs are compared.

Text is compared exactly (cells print rounded, seeded numbers). Figures, HTML and
widget views are not: they are checked by the tests of zerolearn.widgets and by
eye in the built book. Cells whose output holds timings carry the ``nbval-ignore-output`` tag.
"""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("image/png", "image/svg+xml", "text/html", "stderr",
                                   "application/vnd.jupyter.widget-view+json")
