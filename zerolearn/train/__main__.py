"""``python -m zerolearn.train``: the training command line, :func:`zerolearn.cli.main`
(exit codes 0, 1, 2, 130, 143)."""

import sys

from zerolearn.cli import main

if __name__ == "__main__":
    sys.exit(main())
