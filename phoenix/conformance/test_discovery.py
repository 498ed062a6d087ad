"""Discovery: the vendor imports, its probe says it can serve, its devices are described."""

from __future__ import annotations

import re

import pytest

from phoenix.errors import VendorError
from phoenix.vendor import Device, Probe, VendorRuntime

pytestmark = pytest.mark.capability("discovery")

#: ``dddd:bb:dd.f`` (domain may be printed with 4 or 8 hex digits, as CUDA and sysfs do)
PCI_BUS_ID = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def test_vendor_imports(vendor_entry):
    cls = vendor_entry.load()
    assert cls is not None, (
        f"vendor {vendor_entry.name!r} ({vendor_entry.location}) does not import: {vendor_entry.error}"
    )
    assert issubclass(cls, VendorRuntime)


def test_probe_usable(vendor_entry):
    cls = vendor_entry.load()
    assert cls is not None, vendor_entry.error
    probe = cls.probe()  # must not raise, must be cheap
    assert isinstance(probe, Probe), f"probe() returned {probe!r}, not a phoenix.vendor.Probe"
    assert isinstance(probe.reason, str) and probe.reason.strip(), "probe() must say what it found (reason)"
    assert probe.usable, f"probe() says the vendor cannot serve here: {probe.reason}"


def test_runtime_identity(rt, vendor_entry):
    assert isinstance(rt, VendorRuntime)
    assert rt.name == vendor_entry.name, (
        f"Runtime.name is {rt.name!r}, its directory/entry point is {vendor_entry.name!r}"
    )
    page = rt.p2p_page_size
    assert isinstance(page, int) and page >= 4096 and page & (page - 1) == 0, (
        f"p2p_page_size {page!r} is not a power of two >= 4096"
    )
    assert isinstance(rt.is_test_double, bool)


def test_devices_listed(devices):
    assert isinstance(devices, list) and devices, "devices() returned no device although probe() said usable"
    assert all(isinstance(d, Device) for d in devices), "devices() must return phoenix.vendor.Device objects"
    assert [d.ordinal for d in devices] == list(range(len(devices))), (
        f"ordinals must be 0..n-1 in order, got {[d.ordinal for d in devices]}"
    )


def test_device_fields(devices):
    for d in devices:
        assert isinstance(d.name, str) and d.name.strip(), f"device {d.ordinal}: empty name"
        assert isinstance(d.pci_bus_id, str) and PCI_BUS_ID.match(d.pci_bus_id), (
            f"device {d.ordinal}: PCI bus id {d.pci_bus_id!r} is not of the form dddd:bb:dd.f"
        )
        assert isinstance(d.total_memory, int) and d.total_memory > 0, (
            f"device {d.ordinal}: total_memory {d.total_memory!r} is not a positive byte count"
        )
    ids = [d.pci_bus_id.lower() for d in devices]
    assert len(set(ids)) == len(ids), f"devices share a PCI bus id: {ids}"


def test_devices_stable(rt, devices):
    again = rt.devices()
    assert again == devices, "two devices() calls disagree"


def test_set_device_each(rt, devices):
    for d in devices:
        rt.set_device(d.ordinal)
    rt.set_device(0)


def test_set_device_out_of_range(rt, devices):
    for bad in (len(devices), len(devices) + 7, -1):
        with pytest.raises(VendorError):
            rt.set_device(bad)
    rt.set_device(0)
