"""BROKEN ON PURPOSE (test only): device pointer queries give the pointer as the base.

A classic porting slip: reporting the queried address (``devicePointer``) as the
allocation base instead of asking the runtime for the address range. The
conformance suite's ``pointer_queries`` capability must fail (interior pointers).
"""

import dataclasses

from phoenix.vendor import MemoryType
from phoenix.vendors.host.runtime import Runtime as HostRuntime


class Runtime(HostRuntime):
    name = "wrong_pointer_base"
    runtime_description = "BROKEN test vendor: host vendor whose pointer queries report the wrong allocation base"

    def pointer_info(self, ptr):
        info = super().pointer_info(ptr)
        if info.type is MemoryType.DEVICE:
            return dataclasses.replace(info, base=ptr, size=info.size - (ptr - info.base))
        return info
