"""The Python API of the I/O stack: files <-> host or device memory.

Core side, control plane: the public face of the I/O modules, which it re-exports
(``_abi``: the C ABI; ``_engine``: engines, the vendor's runtime and the settings
applied to it; ``_futures``; ``_extents``: buffer resolution and registrations;
``_files``: :class:`PhxFile`; ``_batch``; ``_pagecache``; ``_info``). Familiar to
KvikIO users::

    import phoenix.io as pio
    with pio.open("/data/kv.bin", "r") as f:
        fut = f.pread(tensor)              # IOFuture; fut.result() -> bytes read
        n = f.read(tensor, size, file_offset=4096, buf_offset=0)
        op = f.read_async(tensor, size, 0, 0, stream)   # ordered on the stream
        ...                                # after the stream completes: op.bytes_done
    results = pio.batch([(f, buf, size, file_offset, buf_offset, "read"), ...])

Python only checks arguments, finds the buffer's extent (:mod:`phoenix.buffers`), asks
the vendor where it lives and submits; chunking, the file I/O, device copies,
completions and stream callbacks run in the C core (``phoenix/csrc/io_*.c``) on its own
threads, without the GIL. Settings (the vendor, threads, chunk size, queue depth,
bounce pool, mode, engine): :mod:`phoenix.settings`; the vendor is the ``vendor``
setting (``PHX_VENDOR``, or ``settings.override(vendor=...)``), resolved by
:mod:`phoenix.registry`.

Paths, chosen per request (``PHX_MODE``, see ``phoenix/csrc/phx_io.h``):

* host memory (pinned, registered or plain): read and written in place, O_DIRECT for
  the aligned body, buffered for unaligned heads and tails; a buffer whose address is
  not aligned like its file offset goes through a bounce slot (a CPU copy);
* device memory the CPU can address (vendor ``direct_capable``: the host vendor's arena,
  P2P-mapped memory later): the same, straight into the device address (``direct``);
* other device memory: O_DIRECT into pinned bounce slots, then the vendor's
  memcpy_async on a per-worker stream, pipelined (``staged``).
* staged reads into device memory of file ranges in the page cache (or tmpfs): once
  the range's window is mmap'd and host-registered (in the background after a first,
  staged read; :func:`fmap_wait`), one vendor copy straight from the mapping per read:
  no bounce buffer, no pread, about a tenth of the CPU. That first read is staged in
  4 MiB chunks, at most 4 bounce slots per worker at a time (a memory copy, then a DMA:
  small chunks overlap the two, few slots keep the DMAs close behind the copies).
  Mappings are cached across opens, LRU under ``PHX_FMAP_CACHE``, dropped on writes through phoenix and when the file's size or
  times change; :func:`fmap_clear` releases them (``fmap_*`` settings, :func:`fmap_info`).

Ordering with the caller's stream (the rule every call keeps):

* an I/O call that touches device memory runs after all work queued so far on the
  caller's stream: a read lands after the work that writes (or reads) its destination,
  a write takes the bytes that work produced;
* a blocking call (``read``, ``write``, ``read_many``, ``write_many``, ``batch``) returns
  with its bytes in place, visible to any work queued after it; a future's bytes are in
  place once ``.result()`` returns; a stream-ordered call (``read_async``/``write_async``)
  is ordered on the stream itself;
* a call that is not stream-ordered (``read``, ``read_many``, ``batch``, ``pread``, the
  writes too) on a file range that a ``write_async`` issued before it writes (through any
  handle of the file) waits on the host until that write is done, even if its stream has
  not reached it yet: a read returns the bytes (and the count) the write left, a write
  lands after it;
* the caller's stream is the call's ``stream=`` (a vendor handle, a torch or CuPy stream,
  anything with ``cuda_stream``, ``ptr`` or ``__cuda_stream__``), else the current stream
  of the buffer's framework (``torch.cuda.current_stream(device)`` for a torch tensor,
  CuPy's current stream for a CuPy array, the stream a ``__cuda_array_interface__``
  names; DLPack producers order their work before the stream given, the default one when
  none is), else the vendor's default stream (0). Host memory is ordered only when the
  call names a stream.

It costs an event, not a synchronize: the call records an event on the caller's stream;
phoenix's copy streams wait for it on the device (the file I/O into bounce buffers runs
meanwhile), and memory the CPU or the disk writes directly waits for it on the host. A
vendor without events makes phoenix synchronize the caller's stream before it submits
(``phx info``, "caller_stream", says which). :mod:`phoenix.streams` finds the stream.

Interruption: a call that raises (KeyboardInterrupt, a signal handler's exception, a
timeout by ``signal.alarm``) or returns owns nothing any more. Every request a blocking
call submitted is waited for, in C, before its exception reaches the caller, so no byte of
the destination or the file changes afterwards, and the buffers it exported (a bytearray)
are let go; a future's requests are waited for when the last future of its call goes; a
stream-ordered call queues its op in C as its last step, so a call that raised queued
nothing. Files and engines count their users in C (``phoenix._phxcalls``), and the locks a
signal handler may re-enter are reentrant: a handler may do phoenix I/O itself. After
``fork()`` the child starts engines of its own; I/O the parent started is not waited for
there (its futures say so: ECHILD).

Errors: :class:`~phoenix.errors.PhxIOError` (an OSError) naming the file, the offset
and the length; a short read at end of file is a count, not an error. A request moves in
chunks that run in parallel: after ENOSPC, EDQUOT, EFBIG or EIO other chunks of it may have
completed, so the range's bytes (in the file, or in the destination) are undefined until the
whole range is moved again; the message says so.
"""

from __future__ import annotations

from . import _abi, _engine, _pagecache
from ._batch import IORequest, batch
from ._engine import prepare, shutdown, use_runtime
from ._extents import deregister, register
from ._files import PhxFile, open
from ._futures import IOFuture, StreamIO
from ._info import capabilities, sizes, stats
from ._pagecache import fmap_clear, fmap_info, fmap_wait
from .errors import PhxIOError

__all__ = [
    "PhxFile",
    "IOFuture",
    "StreamIO",
    "IORequest",
    "open",
    "batch",
    "register",
    "deregister",
    "capabilities",
    "stats",
    "sizes",
    "shutdown",
    "prepare",
    "use_runtime",
    "fmap_wait",
    "fmap_clear",
    "fmap_info",
    "PhxIOError",
]

# Reached through phoenix.io by libphxfile's driver (a context of its own), the benchmarks
# and the tests: the C ABI, the engine's settings and runtime, and test hooks.
OP_READ, OP_WRITE, MODE, ENGINE, FMAP_MODE, MEM_NAME = (
    _abi.OP_READ,
    _abi.OP_WRITE,
    _abi.MODE,
    _abi.ENGINE,
    _abi.FMAP_MODE,
    _abi.MEM_NAME,
)
_lib = _abi._lib
_RegInfo = _abi._RegInfo
make_config = _engine.make_config
fmap_register_flags = _engine.fmap_register_flags
_runtime = _engine._runtime
_current_engine = _engine._current_engine
_using_engine = _engine._using_engine
_fmap_lookup = _pagecache._fmap_lookup
