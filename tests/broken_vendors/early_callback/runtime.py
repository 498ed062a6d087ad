"""BROKEN ON PURPOSE (test only): the stream host callback runs at launch time.

It runs ``fn(arg)`` in the caller, before the work queued earlier on the stream has
finished. Bad arguments are still refused as the host vendor refuses them, so only
the ordering is wrong. The conformance suite's ``stream_ordering`` capability must fail.
"""

import ctypes

from phoenix.vendors.host.runtime import Runtime as HostRuntime

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
#: free(NULL) does nothing: a C no-op of the callback's signature, queued to check the stream
_NOOP = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value


class Runtime(HostRuntime):
    name = "early_callback"
    runtime_description = "BROKEN test vendor: host vendor whose host callbacks run at launch, not in stream order"

    def launch_host_func(self, stream, fn, arg):
        if not fn:
            return super().launch_host_func(stream, fn, arg)  # refused as usual
        super().launch_host_func(stream, _NOOP, 0)  # a bad stream is refused as usual
        _HOST_FN(fn)(arg)  # the defect: now, not after the work queued before it
