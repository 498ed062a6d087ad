"""BROKEN ON PURPOSE (test only): a double free crashes the process instead of raising.

As a runtime without bookkeeping would. The conformance suite's ``errors``
capability must fail with the crash recorded, and the rest of the suite must still
run (``phx-port test`` resumes in a fresh process after the crashed test).
"""

import os
import signal

from phoenix.vendors.host.runtime import Runtime as HostRuntime


class Runtime(HostRuntime):
    name = "crash_on_double_free"
    runtime_description = "BROKEN test vendor: host vendor that crashes (SIGSEGV) on a double free"

    def __init__(self):
        super().__init__()
        self._freed = set()

    def device_alloc(self, size, device=0):
        ptr = super().device_alloc(size, device)
        self._freed.discard(ptr)
        return ptr

    def device_free(self, ptr):
        if ptr in self._freed:
            os.kill(os.getpid(), signal.SIGSEGV)  # the defect: what an unchecked free() may do
        super().device_free(ptr)
        self._freed.add(ptr)
