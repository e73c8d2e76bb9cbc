"""Step-through players that need no network: the book's copy of matplotlib's animation HTML.

matplotlib's ``Animation.to_jshtml`` starts with a ``<link>`` to Font Awesome on a CDN for
its buttons' icons. The book's theme already ships Font Awesome (it draws the same
``fa fa-...`` icons from its own files), so the link is dropped from every HTML output as
the page is written: the pages then ask no server for anything, read from ``file://``.
"""

import re

from docutils import nodes

CDN_LINK = re.compile(r'<link rel="stylesheet"\s+href="https://maxcdn\.bootstrapcdn\.com/font-awesome/[^"]*">\s*')


def drop_cdn_links(app, doctree, docname) -> None:
    for node in list(doctree.findall(nodes.raw)):
        if "html" in node.get("format", "").split() and CDN_LINK.search(node.astext()):
            node.replace_self(nodes.raw("", CDN_LINK.sub("", node.astext()), format=node["format"]))


def setup(app):
    app.connect("doctree-resolved", drop_cdn_links)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
