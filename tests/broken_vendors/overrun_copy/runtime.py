"""BROKEN ON PURPOSE (test only): every copy moves one byte more than asked.

The conformance suite's ``copies`` capability must fail: the byte after each
destination extent is poison and is checked (or the runtime refuses the extent).
"""

from phoenix.vendors.host.runtime import Runtime as HostRuntime


class Runtime(HostRuntime):
    name = "overrun_copy"
    runtime_description = "BROKEN test vendor: host vendor whose copies write one byte past the end"

    def memcpy(self, dst, src, size, kind):
        super().memcpy(dst, src, size + 1 if size else 0, kind)

    def memcpy_async(self, dst, src, size, kind, stream):
        super().memcpy_async(dst, src, size + 1 if size else 0, kind, stream)
