"""BROKEN ON PURPOSE (test only): the data path's events do not wait.

Its data-path table has every event entry, but ``stream_wait_event`` and
``event_synchronize`` return success at once (libc's ``sched_yield``: returns 0, and
ignores the arguments), so the I/O core believes the caller's stream has passed the
point it recorded. Blocking calls and futures then race the work the caller queued
before them. The conformance suite's ``io_caller_stream`` capability must fail.
"""

import ctypes

from phoenix.vendors.host.runtime import Runtime as HostRuntime

#: a C function that returns 0 whatever it is given
_RETURNS_ZERO = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value


class Runtime(HostRuntime):
    name = "skip_stream_wait"
    runtime_description = "BROKEN test vendor: host vendor whose stream_wait_event and event_synchronize do not wait"

    def data_path(self):
        table = super().data_path()
        table.stream_wait_event = _RETURNS_ZERO  # the defect: nothing waits for the caller's stream
        table.event_synchronize = _RETURNS_ZERO
        return table
