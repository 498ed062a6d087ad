"""BROKEN ON PURPOSE (test only): every copy drops its last byte.

The conformance suite's ``copies`` capability must fail: destinations are poisoned
before each copy and every byte is checked afterwards.
"""

from phoenix.vendors.host.runtime import Runtime as HostRuntime


class Runtime(HostRuntime):
    name = "short_copy"
    runtime_description = "BROKEN test vendor: host vendor whose copies drop their last byte"

    def memcpy(self, dst, src, size, kind):
        super().memcpy(dst, src, max(size - 1, 0), kind)

    def memcpy_async(self, dst, src, size, kind, stream):
        super().memcpy_async(dst, src, max(size - 1, 0), kind, stream)
