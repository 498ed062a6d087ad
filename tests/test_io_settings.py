"""Settings: environment, set(), override blocks, validation; engines and capabilities."""

from __future__ import annotations

import os

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.registry import get_runtime


def test_environment_and_layers(monkeypatch):
    monkeypatch.setenv("PHX_THREADS", "3")
    monkeypatch.setenv("PHX_CHUNK_SIZE", "1M")
    monkeypatch.setenv("PHX_QUEUE_DEPTH", "7")
    monkeypatch.setenv("PHX_BOUNCE_POOL_SIZE", "64MiB")
    monkeypatch.setenv("PHX_MODE", "Staged")
    monkeypatch.setenv("PHX_IO_ENGINE", "threads")
    s = ps.get()
    assert (s.threads, s.chunk_size, s.queue_depth, s.bounce_pool_size, s.mode, s.engine) == (
        3,
        1 << 20,
        7,
        64 << 20,
        "staged",
        "threads",
    )
    try:
        ps.set(threads=5)
        assert ps.get().threads == 5
        with ps.override(threads=9, chunk_size="16M") as inner:
            assert inner.threads == 9 and ps.get().chunk_size == 16 << 20
            with ps.override(threads=2):
                assert ps.get().threads == 2
            assert ps.get().threads == 9
        assert ps.get().threads == 5 and ps.get().chunk_size == 1 << 20
        sources = {d["name"]: d["source"] for d in ps.describe()}
        assert sources["threads"] == "set()" and sources["mode"] == "environment"
    finally:
        ps.reset()
    assert ps.get().threads == 3


@pytest.mark.parametrize(
    "var,value,msg",
    [
        ("PHX_THREADS", "0", "between 1 and 1024"),
        ("PHX_CHUNK_SIZE", "1000", "multiple of 4096"),
        ("PHX_QUEUE_DEPTH", "lots", "not an integer"),
        ("PHX_MODE", "fast", "auto, staged, direct"),
        ("PHX_IO_ENGINE", "aio", "auto, io_uring, threads"),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch, var, value, msg):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=msg) as ei:
        ps.get()
    assert var in str(ei.value)


@pytest.mark.parametrize("name", ["inflight", "bounce_pool_size", "fmap_cache", "fmap_window"])
def test_sizes_past_2_63_are_refused_not_wrapped(monkeypatch, name):
    """Sizes the C core holds in 64 bits: past 2**63-1 refused (a ctypes c_uint64 would take
    2**64 + 1M as 1M), from override() and from the environment."""
    for value in ((1 << 64) + (2 << 20), 1 << 63):
        with pytest.raises(ValueError, match=f"{name}={value} is past 2\\*\\*63-1"):
            with ps.override(**{name: value}):
                pass
    var = ps.ENV[name]
    monkeypatch.setenv(var, str((1 << 64) + (2 << 20)))
    with pytest.raises(ValueError, match="past 2\\*\\*63-1") as ei:
        ps.get()
    assert var in str(ei.value)


def test_sizes_are_parsed_exactly():
    """Sizes past 2**53 are the integers written (a float once rounded them: 2**63-1 became
    2**63 and was refused, 2**53+1 became 2**53); fractions of a byte, sizes past 2**63-1 and
    exponents past 30 (1e999999999 took minutes to make exactly) are refused, at once."""
    import time

    from phoenix.vendor import parse_size

    for text, want in (
        ("9007199254740993", 2**53 + 1),
        ("9223372036854775807", 2**63 - 1),
        ("1.5K", 1536),
        ("64KiB", 65536),
        ("1e3", 1000),
        ("1_000", 1000),
        (".5K", 512),
    ):
        assert parse_size(text) == want, text
    t0 = time.perf_counter()
    for bad in ("0.5", "1/2", "-1", "nan", "inf", "abc", "e5", "18446744073709551617", "1e999999999", "1e-999999999"):
        with pytest.raises(ValueError, match="bad size"):
            parse_size(bad)
    assert time.perf_counter() - t0 < 5
    with ps.override(inflight="9223372036854775807"):
        assert ps.get().inflight == 2**63 - 1


def test_a_bounce_pool_of_any_accepted_size_serves_reads(rt, tmp_path):
    """A pool size that is no whole number of 64 KiB units (1100000, 50000000) still gives
    slots (its segment was rounded past it, so none could ever be made: every staged read
    failed with ENOMEM); a misaligned host buffer reads every byte through it."""
    path = tmp_path / "odd.bin"
    data = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)
    data.tofile(path)
    for pool in (1_100_000, 50_000_000):
        pio.shutdown()
        out = np.zeros((3 << 20) + 64, np.uint8)
        with ps.override(bounce_pool_size=pool, engine="io_uring"), pio.open(path, "r") as f:
            assert f.read(out, 3 << 20, 0, 7) == 3 << 20
        assert np.array_equal(out[7 : 7 + (3 << 20)], data) and not out[:7].any() and not out[7 + (3 << 20) :].any()
    pio.shutdown()


def test_a_bounce_pool_larger_than_memory_is_refused():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ValueError, match="more than this machine's memory"):
        with ps.override(bounce_pool_size=ram + (1 << 30)):
            pass
    with ps.override(bounce_pool_size="64M"):
        assert ps.get().bounce_pool_size == 64 << 20


def test_override_validates():
    with pytest.raises(TypeError, match="unknown setting"):
        with ps.override(thread=4):
            pass
    with pytest.raises(ValueError, match="chunk_size"):
        with ps.override(chunk_size=123):
            pass


def test_docstring_documents_every_setting():
    for name, var in ps.ENV.items():
        assert f"``{name}``" in ps.__doc__ and f"``{var}``" in ps.__doc__


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_engine_setting_selects_the_engine(rt, engine, tmp_path):
    if engine == "io_uring" and not pio.capabilities()["engines"]["io_uring"]["available"]:
        pytest.skip("io_uring unavailable here")
    data = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    with ps.override(engine=engine, threads=2):
        before = pio.stats()["uring_enters"]
        with pio.open(tmp_path / "e.bin", "w+") as f:
            assert f.write(data) == data.nbytes
        assert pio._current_engine().engine == engine
        entered = pio.stats()["uring_enters"] - before
    assert (entered > 0) == (engine == "io_uring")


def test_capabilities_say_why(rt, tmp_path):
    caps = pio.capabilities(tmp_path)
    assert caps["engines"]["threads"]["available"]
    assert caps["engines"]["auto"] in ("io_uring", "threads") and caps["engines"]["auto_why"]
    assert caps["o_direct"]["path"] == str(tmp_path) and "why" in caps["o_direct"]
    assert caps["vendor"]["name"] == "host" and caps["vendor"]["data_path"] == "complete"
    modes = caps["modes"]
    assert modes["host"]["available"] and modes["direct"]["available"] and modes["staged"]["available"]
    zc = modes["zero_copy_file_mappings"]
    assert zc["available"] and "one DMA per read" in zc["why"] and zc["state"]["mode"] == "auto"
    assert caps["stream_ordered"]["available"]
    assert "available" in caps["page_cache_probe"] and caps["page_cache_probe"]["why"]
    assert set(caps["settings"]) == set(ps.DEFAULTS)


def test_bounce_pool_auto(monkeypatch):
    """The bounce pool defaults to auto (0: sized by the context from threads and chunk
    size); 'auto' is accepted from the environment and in overrides; tiny sizes are refused."""
    monkeypatch.delenv("PHX_BOUNCE_POOL_SIZE", raising=False)
    assert ps.get().bounce_pool_size == 0
    monkeypatch.setenv("PHX_BOUNCE_POOL_SIZE", "Auto")
    assert ps.get().bounce_pool_size == 0
    monkeypatch.setenv("PHX_BOUNCE_POOL_SIZE", "512M")
    assert ps.get().bounce_pool_size == 512 << 20
    with ps.override(bounce_pool_size="auto"):
        assert ps.get().bounce_pool_size == 0
    with pytest.raises(ValueError, match="bounce_pool_size"):
        with ps.override(bounce_pool_size=4096):
            pass


def test_prepare_pins_the_whole_bounce_pool():
    """prepare() starts the pool for the current settings and pins its bounce pool at once
    (not on first need), and the I/O that follows uses that pool: no growth."""
    pio.shutdown()
    with ps.override(threads=2, chunk_size="1M", bounce_pool_size="8M"):
        assert pio.stats()["bounce_bytes"] == 0
        info = pio.prepare()
        assert info["bounce_bytes"] == 8 << 20 == pio.stats()["bounce_bytes"]
        rt = get_runtime()
        n = 3 << 20
        dev = rt.device_alloc(n)
        try:
            data = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
            import tempfile

            with tempfile.NamedTemporaryFile() as tf:
                data.tofile(tf.name)
                with ps.override(mode="staged"), pio.open(tf.name) as f:
                    assert f.read((dev, n), n, 0, 0) == n
            out = np.empty(n, np.uint8)
            from phoenix.vendor import CopyKind

            rt.memcpy(out.ctypes.data, dev, n, CopyKind.DEVICE_TO_HOST)
            assert np.array_equal(out, data)
            assert pio.stats()["bounce_bytes"] == 8 << 20  # the prepared pool, not grown
        finally:
            rt.device_free(dev)
    pio.shutdown()
    assert pio.stats()["bounce_bytes"] == 0
