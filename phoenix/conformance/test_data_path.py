"""The data-path table: raw C entry points the I/O core calls from its threads, no GIL.

Beyond "every REQUIRED field is set", the table is used here exactly as the C core
uses it: through its raw function pointers (ctypes CFUNCTYPE calls release the GIL
like the core's own threads do), with the table's kinds, flags and success value.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from phoenix.vendor import DATA_PATH_ABI, DataPathTable

from .plugin import POISON, READBACK_POISON, assert_bytes, random_bytes

pytestmark = pytest.mark.capability("data_path_table")

c_int, c_uint, c_size_t, c_void_p = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p
SIGNATURES = {  # the C signatures of phoenix/csrc/phx_vendor.h (CUDA's)
    "set_device": ctypes.CFUNCTYPE(c_int, c_int),
    "memcpy_async": ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_int, c_void_p),
    "stream_create": ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_void_p), c_uint),
    "stream_synchronize": ctypes.CFUNCTYPE(c_int, c_void_p),
    "stream_destroy": ctypes.CFUNCTYPE(c_int, c_void_p),
    "launch_host_func": ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p),
    "host_register": ctypes.CFUNCTYPE(c_int, c_void_p, c_size_t, c_uint),
    "host_unregister": ctypes.CFUNCTYPE(c_int, c_void_p),
    # the events group (optional, all or none)
    "get_device": ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_int)),
    "event_create": ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_void_p), c_uint),
    "event_record": ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p),
    "stream_wait_event": ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint),
    "event_synchronize": ctypes.CFUNCTYPE(c_int, c_void_p),
    "event_destroy": ctypes.CFUNCTYPE(c_int, c_void_p),
    # completion by polling (optional, with the events)
    "event_query": ctypes.CFUNCTYPE(c_int, c_void_p),
}


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", c_void_p),
    ]


def _shared_object_of(address: int) -> str | None:
    """The loaded object (library or executable) containing ``address``, via dladdr."""
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not libc.dladdr(address, ctypes.byref(info)):
        return None
    return (info.dli_fname or b"?").decode(errors="replace")


@pytest.fixture(scope="module")
def table(rt) -> DataPathTable:
    return rt.data_path()


class Raw:
    """The table's functions as ctypes callables that assert the table's success value."""

    def __init__(self, table: DataPathTable):
        self.table = table
        for name, proto in SIGNATURES.items():
            if getattr(table, name):
                setattr(self, "_" + name, proto(getattr(table, name)))

    def __getattr__(self, name):
        fn = self.__dict__.get("_" + name)
        if fn is None:
            raise AttributeError(name)

        def call(*args):
            rc = fn(*args)
            assert rc == self.table.success, f"data-path {name}{args} returned {rc}, success is {self.table.success}"
            return rc

        return call


def test_table_type_and_abi(table):
    assert isinstance(table, DataPathTable), f"data_path() returned {type(table).__name__}, not DataPathTable"
    assert table.abi_version == DATA_PATH_ABI, (
        f"abi_version {table.abi_version}, this phoenix expects {DATA_PATH_ABI} (phoenix/vendor.py DATA_PATH_ABI)"
    )


def test_required_fields_set(table):
    assert table.missing() == [], f"REQUIRED data-path entries left NULL: {table.missing()}"


def test_copy_kinds_distinct(table):
    kinds = [table.kind_h2h, table.kind_h2d, table.kind_d2h, table.kind_d2d]
    assert len(set(kinds)) == 4, f"kinds h2h/h2d/d2h/d2d must be distinct, got {kinds}"


def test_events_all_or_none(table):
    """The events group is complete or absent (absent: the core synchronizes the caller's
    stream instead, and phx info says so)."""
    gone = table.missing_events()
    assert gone in ([], list(DataPathTable.EVENTS)), f"the events group is incomplete: missing {gone}"


def test_entries_are_c_functions(table):
    """Each REQUIRED entry (and event entry) lies in a loaded shared object: C code, not a
    Python callback."""
    bad = {}
    for name in DataPathTable.REQUIRED + tuple(n for n in (*DataPathTable.EVENTS, "event_query") if getattr(table, n)):
        where = _shared_object_of(getattr(table, name))
        if where is None or "libffi" in where:
            bad[name] = where or "no loaded object (a ctypes/Python callback?)"
    assert not bad, f"data-path entries that are not C functions of a library: {bad}"


def test_raw_stream_round_trip(rt, mem, rng, table, chelper, devices):
    """stream_create, memcpy_async both ways, launch_host_func, synchronize, destroy: all raw."""
    raw = Raw(table)
    n = 1 * 1024 * 1024 + 3
    for d in devices:
        raw.set_device(d.ordinal)
        stream = c_void_p()
        raw.stream_create(ctypes.byref(stream), table.stream_flags)
        try:
            src, src_view = mem.pinned(n)
            out, out_view = mem.pinned(n)
            dev = mem.dev(n, d.ordinal)
            data = random_bytes(rng, n)
            src_view[:] = data
            out_view[:] = POISON
            snap = mem.keep(np.full(n, READBACK_POISON, dtype=np.uint8))
            task = chelper.task(src=out, dst=snap.ctypes.data, n=n)
            raw.memcpy_async(c_void_p(dev), c_void_p(src), n, table.kind_h2d, stream)
            raw.memcpy_async(c_void_p(out), c_void_p(dev), n, table.kind_d2h, stream)
            raw.launch_host_func(stream, c_void_p(chelper.fn), c_void_p(task.address))
            raw.stream_synchronize(stream)
            assert task.calls == 1, "the raw launch_host_func callback did not run"
            assert_bytes(out_view, data, f"device {d.ordinal}: raw H2D then D2H on a raw stream")
            assert_bytes(snap, data, f"device {d.ordinal}: raw callback's view after the raw copies")
        finally:
            raw.stream_destroy(stream)
    raw.set_device(0)


def test_raw_host_register(rt, mem, table):
    raw = Raw(table)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    raw.host_register(c_void_p(buf.ctypes.data), buf.nbytes, table.host_register_flags)
    try:
        info = rt.pointer_info(buf.ctypes.data)
        assert info.type.value == "host_pinned", f"memory registered through the raw table is reported as {info}"
    finally:
        raw.host_unregister(c_void_p(buf.ctypes.data))


def _staging(mem, rng, n):
    """A pinned source of random bytes, a poisoned pinned destination (and its view), device
    memory on the current device, and the bytes: what a copy through the device needs."""
    src, src_view = mem.pinned(n)
    out, out_view = mem.pinned(n)
    data = random_bytes(rng, n)
    src_view[:] = data
    out_view[:] = POISON
    return src, out, out_view, mem.dev(n), data


def test_raw_events_order_two_streams(rt, mem, rng, table, chelper):
    """An event recorded on stream A (held, then a copy into device memory) and waited for
    by stream B: B's copy out of that memory sees A's bytes; event_synchronize returns
    after A passed the record; get_device names the current device."""
    if table.missing_events():
        pytest.skip("the vendor has no events: the I/O core synchronizes the caller's stream instead")
    raw = Raw(table)
    n = 256 * 1024 + 7
    cur = c_int(-1)
    raw.get_device(ctypes.byref(cur))
    raw.set_device(0)
    raw.get_device(ctypes.byref(cur))
    assert cur.value == 0, f"get_device says {cur.value} after set_device(0)"
    a, b, ev = c_void_p(), c_void_p(), c_void_p()
    raw.stream_create(ctypes.byref(a), table.stream_flags)
    raw.stream_create(ctypes.byref(b), table.stream_flags)
    raw.event_create(ctypes.byref(ev), table.event_flags)
    try:
        src, out, out_view, dev, data = _staging(mem, rng, n)
        hold = chelper.task(sleep_s=0.1)
        raw.launch_host_func(a, c_void_p(chelper.fn), c_void_p(hold.address))
        raw.memcpy_async(c_void_p(dev), c_void_p(src), n, table.kind_h2d, a)
        raw.event_record(ev, a)
        raw.stream_wait_event(b, ev, 0)
        raw.memcpy_async(c_void_p(out), c_void_p(dev), n, table.kind_d2h, b)
        raw.stream_synchronize(b)
        assert hold.calls == 1, "stream B finished before the callback that held stream A ran: it did not wait"
        assert_bytes(out_view, data, "a copy on stream B after stream_wait_event of an event recorded on stream A")
        raw.event_synchronize(ev)
    finally:
        raw.stream_synchronize(a)
        raw.event_destroy(ev)
        raw.stream_destroy(a)
        raw.stream_destroy(b)


def test_raw_event_query(rt, mem, rng, table, chelper):
    """event_query (optional): `not_ready` while the stream has not reached the record (held
    by a callback, then a copy), `success` once it has; the copy's bytes are there then.
    The io_uring workers poll their copies' events with it instead of host callbacks."""
    if not table.event_query:
        pytest.skip("the vendor has no event_query: the workers learn of their copies by host callbacks")
    assert not table.missing_events(), "event_query is set but the events group is not complete"
    assert table.not_ready != table.success, f"not_ready ({table.not_ready}) equals success"
    raw = Raw(table)
    query = SIGNATURES["event_query"](table.event_query)
    n = 256 * 1024 + 3
    raw.set_device(0)
    stream, ev = c_void_p(), c_void_p()
    raw.stream_create(ctypes.byref(stream), table.stream_flags)
    raw.event_create(ctypes.byref(ev), table.event_flags)
    try:
        src, out, out_view, dev, data = _staging(mem, rng, n)
        hold = chelper.task(sleep_s=0.2)
        raw.launch_host_func(stream, c_void_p(chelper.fn), c_void_p(hold.address))
        raw.memcpy_async(c_void_p(dev), c_void_p(src), n, table.kind_h2d, stream)
        raw.memcpy_async(c_void_p(out), c_void_p(dev), n, table.kind_d2h, stream)
        raw.event_record(ev, stream)
        rc = query(ev)
        assert rc == table.not_ready, f"event_query behind a held stream returned {rc}, not_ready is {table.not_ready}"
        deadline = time.monotonic() + 30
        while (rc := query(ev)) == table.not_ready and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rc == table.success, f"event_query returned {rc} after the stream passed the record"
        assert hold.calls == 1, "event_query said done before the callback holding the stream ran"
        assert_bytes(out_view, data, "the copies before an event event_query says is done")
    finally:
        raw.stream_synchronize(stream)
        raw.event_destroy(ev)
        raw.stream_destroy(stream)
