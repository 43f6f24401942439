"""Loaded by every Python process whose PYTHONPATH starts with this folder (the multi-process tests
put it there): records, through Python's audit hooks (PEP 578), every file this process opens
for writing, renames, replaces or removes under $JAXRAG_WRITE_AUDIT_ROOT, one tab-separated line
per event in $JAXRAG_WRITE_AUDIT/process-$JAX_PROCESS_ID.tsv. Orbax's array files are written by
tensorstore (C++), outside Python: they are not seen here."""

import os
import sys

_root = os.environ.get("JAXRAG_WRITE_AUDIT_ROOT")
_out = os.environ.get("JAXRAG_WRITE_AUDIT")
if _root and _out:
    _root = os.path.realpath(_root)
    os.makedirs(_out, exist_ok=True)
    _fd = os.open(os.path.join(_out, f"process-{os.environ.get('JAX_PROCESS_ID', 'x')}-{os.getpid()}.tsv"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _under(path):
        try:
            path = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        return os.path.relpath(path, _root) if path == _root or path.startswith(_root + os.sep) else None

    def _record(event, *paths):
        rel = [_under(p) for p in paths]
        if any(r is not None for r in rel):
            os.write(_fd, ("\t".join([event, *(r or "-" for r in rel)]) + "\n").encode())

    def _hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing:
                _record("write", args[0])
        elif event in ("os.rename", "os.replace"):
            _record(event, args[0], args[1])
        elif event in ("os.remove", "os.rmdir", "shutil.rmtree"):
            _record(event, args[0])

    sys.addaudithook(_hook)
