"""Shared test set-up: the host reference vendor unless a run asks for another.

Tests that need a GPU or a kernel module skip with the reason where those are absent.
"""

import os

os.environ.setdefault("PHX_VENDOR", "host")
