"""A read-only FUSE view of a folder that answers every metadata request after a fixed delay: a stand-in for a
parallel filesystem's metadata server (Lustre, GPFS, NFS), where each lookup, stat, open or readdir waits on a
network round trip while data reads stream.

    python bench/latency_fs.py SRC MOUNTPOINT --latency-ms 0.5      # foreground; unmount: umount MOUNTPOINT

Used by bench/staging.py --latency-ms. Needs root (or fusermount), /dev/fuse, libfuse2 (Debian: libfuse2) and
fusepy (`pip install fusepy`). Directory listings carry each entry's type, as a parallel filesystem's do, so
a walker needs no stat to tell files from folders; attributes and names are never cached by the kernel
(attr_timeout = entry_timeout = 0), as on a node that has not seen the dataset yet. Every request is served on
its own thread, so concurrent requests overlap their delays the way a metadata server's do.
"""

from __future__ import annotations

import argparse
import os
import time

STAT_FIELDS = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid", "st_ino")


def serve(src: str, mountpoint: str, latency_s: float) -> None:
    from fuse import FUSE, FuseOSError, Operations

    class Delayed(Operations):
        def _path(self, path: str) -> str:
            return os.path.join(src, path.lstrip("/"))

        def getattr(self, path, fh=None):
            time.sleep(latency_s)
            try:
                st = os.lstat(self._path(path))
            except OSError as exc:
                raise FuseOSError(exc.errno) from exc
            return {name: getattr(st, name) for name in STAT_FIELDS}

        def readdir(self, path, fh):
            time.sleep(latency_s)
            entries = [".", ".."]
            with os.scandir(self._path(path)) as it:
                for entry in it:
                    entries.append((entry.name, {"st_mode": entry.stat(follow_symlinks=False).st_mode,
                                                 "st_ino": entry.inode()}, 0))
            return entries

        def open(self, path, flags):
            time.sleep(latency_s)
            try:
                return os.open(self._path(path), flags)
            except OSError as exc:
                raise FuseOSError(exc.errno) from exc

        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        def release(self, path, fh):
            os.close(fh)

    FUSE(Delayed(), mountpoint, foreground=True, nothreads=False, ro=True, use_ino=True, attr_timeout=0,
         entry_timeout=0, negative_timeout=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("mountpoint")
    parser.add_argument("--latency-ms", type=float, default=0.5)
    args = parser.parse_args()
    serve(os.path.realpath(args.src), args.mountpoint, args.latency_ms / 1000)


if __name__ == "__main__":
    main()
