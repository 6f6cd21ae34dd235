"""Which filesystem a path sits on, and whether it is one a trace file
should not: a network filesystem (NFS, SMB, 9p, Lustre, GPFS, CephFS, a
FUSE mount such as sshfs) makes each page the ring's first lap touches a
round trip, where a local disk or tmpfs makes it a minor fault, and what
reaches the server before a crash is up to its client. Read from
/proc/self/mountinfo (Linux; elsewhere nothing is said). Torch-free."""

from __future__ import annotations

import os

_MOUNTINFO = "/proc/self/mountinfo"
_MAX_MOUNTS = 100_000  # lines read of the mount table (a container may list many)
# Filesystem types (mountinfo's words) a trace file is slow or unsafe on, and how to say them.
_NETWORK = {"nfs": "NFS", "nfs4": "NFS", "cifs": "SMB", "smb3": "SMB", "smbfs": "SMB", "9p": "9p",
            "lustre": "Lustre", "gpfs": "GPFS", "ceph": "CephFS", "glusterfs": "GlusterFS", "beegfs": "BeeGFS",
            "afs": "AFS", "davfs": "WebDAV"}


def _unescaped(field: str) -> str:
    """A mount point as mountinfo writes it: space, tab, newline and backslash as octal escapes."""
    for escape, character in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escape, character)
    return field


def filesystem_of(path: str) -> "str | None":
    """The type of the filesystem holding `path` (or, while it does not
    exist, its nearest existing parent), as the mount table names it
    (`ext4`, `tmpfs`, `nfs4`, `fuse.sshfs`); None where there is no table."""
    where = os.path.realpath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    best, found = -1, None
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="replace") as table:
            for number, line in enumerate(table):
                if number >= _MAX_MOUNTS:
                    break
                fields = line.split()
                if "-" not in fields or len(fields) < 5:
                    continue
                mount = _unescaped(fields[4])
                kind = fields[fields.index("-") + 1] if fields.index("-") + 1 < len(fields) else None
                inside = where == mount or where.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= best:  # the innermost mount; the last of equal ones is on top
                    best, found = len(mount), kind
    except OSError:
        return None
    return found


def slow_filesystem(path: str) -> "str | None":
    """`NFS (nfs4)` when `path` sits on a network or FUSE filesystem, else None."""
    kind = filesystem_of(path)
    if kind is None:
        return None
    if kind in _NETWORK:
        return f"{_NETWORK[kind]} ({kind})"
    if kind == "fuse" or kind.startswith("fuse."):
        return f"a FUSE mount ({kind})"
    return None


def slow_filesystem_note(path: str) -> "str | None":
    """A sentence for a user whose trace file sits on such a filesystem, or None."""
    slow = slow_filesystem(path)
    if slow is None:
        return None
    return (f"{path} is on {slow}, a network or FUSE filesystem: the first lap of a trace file's ring waits on it page by "
            "page, and what a crash leaves reaches the server only if its client sends it; point "
            "SGLANG_KERNEL_API_TRACEFILE at a local disk or /dev/shm")
