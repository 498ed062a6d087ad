"""The loaders ``phx bench loader`` measures phxloader against: ``safetensors`` and fastsafetensors.

Benchmark side, control plane. Each ``*_impl(path, device, torch, sync)`` answers ``(fn,
None, info)`` where the peer can load ``path`` onto ``device`` here (``fn()`` loads the
whole file, waits for the device, frees it all and returns the bytes loaded; ``info`` is
what the record says of it), or ``(None, why, None)`` where it cannot: the bench skips it
and prints and records ``why``. Both are called through their own documented APIs, with
their defaults except where a default would change the other implementations' figures.
"""

from __future__ import annotations


def nbytes_of(t) -> int:
    """Bytes of a tensor (torch) or an array (NumPy)."""
    n = getattr(t, "nbytes", None)
    return int(n) if n is not None else t.numel() * t.element_size()


def _not_torch_device(device) -> str | None:
    if str(device).startswith("phx"):
        return "loads into torch devices (cuda, cpu), not phx device memory: run with --device cuda"
    return None


def safetensors_impl(path: str, device, torch, sync):
    """``safetensors.torch.load_file(path, device=...)``: maps the file and copies tensor by
    tensor (on ``cpu`` it only maps it: tensors are paged in when touched, not comparable)."""
    if torch is None:
        return None, "needs torch (safetensors.torch.load_file; torch is not installed)", None
    try:
        import safetensors
        from safetensors.torch import load_file as st_load
    except Exception as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})", None
    why = _not_torch_device(device)
    if why:
        return None, why, None

    def run() -> int:
        sd = st_load(path, device=str(device))
        sync()
        n = sum(nbytes_of(t) for t in sd.values())
        del sd
        return n

    info = {"api": f"safetensors.torch.load_file(path, device={str(device)!r})"}
    info["version"] = getattr(safetensors, "__version__", None)
    if str(device) == "cpu":
        info["note"] = "on cpu the file is only mapped (tensors paged in when touched): not comparable"
    return run, None, info


def fastsafetensors_impl(path: str, device, torch, sync):
    """fastsafetensors' documented single-device load: ``SafeTensorsFileLoader(SingleGroup(),
    device, nogds=True)`` (its pread path through bounce buffers; phoenix has no GDS here
    either), ``add_filenames``, ``copy_files_to_device``, ``get_tensor`` of every key, then
    ``close`` of both. ``set_numa=False``: its default binds the whole process to the GPU's
    NUMA node, which would move the other implementations' figures too."""
    try:
        import fastsafetensors
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except Exception as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})", None
    if torch is None:
        return None, "needs torch (its pytorch framework; torch is not installed)", None
    why = _not_torch_device(device)
    if why:
        return None, why, None
    # it wants an indexed device ("cuda:0"; plain "cuda" is refused)
    dev = str(device)
    if dev == "cuda":
        dev = f"cuda:{torch.cuda.current_device()}"

    def run() -> int:
        loader = SafeTensorsFileLoader(SingleGroup(), dev, nogds=True, set_numa=False)
        try:
            loader.add_filenames({0: [path]})
            fb = loader.copy_files_to_device()
            try:
                tensors = {k: fb.get_tensor(k) for k in loader.get_keys()}
                sync()
                n = sum(nbytes_of(t) for t in tensors.values())
                del tensors
            finally:
                fb.close()
        finally:
            loader.close()
        return n

    info = {
        "api": f"SafeTensorsFileLoader(SingleGroup(), {dev!r}, nogds=True, set_numa=False)",
        "version": getattr(fastsafetensors, "__version__", None),
    }
    return run, None, info
