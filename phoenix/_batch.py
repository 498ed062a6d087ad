"""Batches: many requests, over any files and buffers, submitted at once (:func:`batch`).

Core side, control plane. A batch is normalized here and submitted like a file's own
calls (:mod:`phoenix._files`); waiting for all of it is one C call without the GIL. A
malformed or refused request fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._files import PhxFile, _submit_many
from ._futures import IOFuture


@dataclass
class IORequest:
    """One request of :func:`batch`."""

    file: PhxFile
    buf: object
    size: int | None = None
    file_offset: int = 0
    buf_offset: int = 0
    op: str = "read"
    priority: str = "normal"  # or "background" (see PhxFile.pwrite)


def _normalize(req, i: int):
    """A request as (file, buf, size, file_offset, buf_offset, op), or the TypeError that
    says why it is not one (returned, not raised: a malformed request fails alone)."""
    if isinstance(req, IORequest):
        return (req.file, req.buf, req.size, req.file_offset, req.buf_offset, req.op, req.priority)
    if isinstance(req, dict):
        unknown = set(req) - {"file", "buf", "size", "file_offset", "buf_offset", "op", "priority"}
        if unknown or "file" not in req or "buf" not in req:
            return TypeError(
                f"request {i}: a dict needs 'file' and 'buf' (and may have size, file_offset, "
                f"buf_offset, op, priority){'; unknown keys ' + ', '.join(sorted(map(str, unknown))) if unknown else ''}"
            )
        return (
            req["file"],
            req["buf"],
            req.get("size"),
            req.get("file_offset", 0),
            req.get("buf_offset", 0),
            req.get("op", "read"),
            req.get("priority", "normal"),
        )
    try:
        t = tuple(req)
    except TypeError:
        return TypeError(
            f"request {i}: (file, buf, size, file_offset, buf_offset, op) expected, got {type(req).__name__}"
        )
    if not 2 <= len(t) <= 7:
        return TypeError(
            f"request {i}: (file, buf, size, file_offset, buf_offset, op, priority) expected, got {len(t)} items"
        )
    defaults = (None, None, None, 0, 0, "read", "normal")
    return t + defaults[len(t) :]


def batch(requests, *, wait: bool = True, stream=None):
    """Submit many requests at once.

    Each request is an :class:`IORequest`, a dict with those keys, or a tuple
    ``(file, buf, size=None, file_offset=0, buf_offset=0, op="read", priority="normal")``
    (``priority="background"``: see :meth:`PhxFile.pwrite`). A failed request
    fails alone. With ``wait`` (default) returns one result per request: the byte count,
    or the :class:`PhxIOError` (not raised); with ``wait=False`` the :class:`IOFuture` list.
    Each request is ordered after its caller's stream (``stream``, else its buffer's).
    """
    reqs = [_normalize(r, i) for i, r in enumerate(requests)]
    if not reqs:
        return []
    if len(reqs) == 1:  # one request raises where it is refused: batch returns the error
        try:
            return _submit_many(reqs, wait=wait, stream=stream)
        except Exception as exc:
            return [IOFuture.failed(exc)] if not wait else [exc]
    return _submit_many(reqs, wait=wait, stream=stream)
