"""Shared test set-up: the host reference vendor unless a run asks for another.

Tests that need a GPU or a kernel module skip with the reason where those are absent.
"""

import os

os.environ.setdefault("PHX_VENDOR", "host")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def rt():
    """The host vendor's runtime, installed as the I/O stack's runtime for one test module."""
    import phoenix.io as pio
    from phoenix.registry import get_runtime

    runtime = get_runtime("host")
    pio.use_runtime(runtime)
    yield runtime
    pio.shutdown()
    pio.use_runtime(None)


@pytest.fixture
def dev(rt):
    """dev(n): a poisoned device buffer of the runtime under test (``_devmem.Dev``), freed after the test."""
    from _devmem import Dev

    made = []

    def make(n):
        d = Dev(rt, n)
        made.append(d)
        return d

    yield make
    for d in made:
        d.free()
