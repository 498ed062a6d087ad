"""BROKEN ON PURPOSE (test only): device pointer queries always say device 0.

A porting slip invisible on a one-device machine: the conformance suite's
``pointer_queries`` capability must fail when the vendor has two devices or more
(run it with ``PHX_HOST_DEVICES=2``).
"""

import dataclasses

from phoenix.vendor import MemoryType
from phoenix.vendors.host.runtime import Runtime as HostRuntime


class Runtime(HostRuntime):
    name = "wrong_pointer_device"
    runtime_description = "BROKEN test vendor: host vendor whose pointer queries always report device 0"

    def pointer_info(self, ptr):
        info = super().pointer_info(ptr)
        if info.type is MemoryType.DEVICE:
            return dataclasses.replace(info, device=0)
        return info
