"""``python -m phoenix``: the same as the ``phx`` command (``python -m phoenix info``)."""

import sys

try:
    from _phx_entry import phx  # the clash check first, as the console script does
except ImportError:  # a source tree whose top level is not on the path
    from phoenix.cli.phx import main as phx

if __name__ == "__main__":
    sys.exit(phx())
