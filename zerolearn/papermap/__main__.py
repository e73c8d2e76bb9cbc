"""``python -m zerolearn.papermap > book/paper_map.md``: print the page."""

import sys

from zerolearn.papermap.page import render

if __name__ == "__main__":
    sys.stdout.write(render())
