"""Where a trace file sits: a network or FUSE filesystem is named, by
`report` (beside its report, which stays as it was) and by `demo`; a local
one is not. The mount table is the test's (/proc/self/mountinfo's format),
so the network mounts need no server."""

import pytest

from sglang_otel_kernels import filesystems

TABLE = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / {base}/models rw,relatime shared:5 - nfs4 10.0.0.2:/models rw,vers=4.2
31 30 0:41 / {base}/models/local rw shared:6 - tmpfs tmpfs rw
32 22 0:42 / {base}/with\040space rw shared:7 - fuse.sshfs me@host:/x rw
33 22 0:43 / {base}/broken
"""


@pytest.fixture
def mounts(tmp_path, monkeypatch):
    table = tmp_path / "mountinfo"
    table.write_text(TABLE.format(base=tmp_path))
    monkeypatch.setattr(filesystems, "_MOUNTINFO", str(table))
    for folder in ("models/local", "with space", "broken"):
        (tmp_path / folder).mkdir(parents=True)
    return tmp_path


def test_the_innermost_mount_names_the_filesystem(mounts):
    assert filesystems.filesystem_of(str(mounts / "models" / "trace_1.sgltrace")) == "nfs4"
    assert filesystems.filesystem_of(str(mounts / "models" / "local")) == "tmpfs"  # mounted over the NFS one
    assert filesystems.filesystem_of(str(mounts / "with space")) == "fuse.sshfs"  # mountinfo's \040 read as a space
    assert filesystems.filesystem_of(str(mounts / "broken")) == "ext4"  # a line without its fields is skipped
    assert filesystems.filesystem_of(str(mounts / "modelsx")) == "ext4"  # a prefix of the name is no mount of it
    assert filesystems.slow_filesystem(str(mounts / "models")) == "NFS (nfs4)"
    assert filesystems.slow_filesystem(str(mounts / "with space")) == "a FUSE mount (fuse.sshfs)"
    assert filesystems.slow_filesystem(str(mounts / "models" / "local")) is None
    assert filesystems.slow_filesystem(str(mounts)) is None


def test_without_a_mount_table_nothing_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystems, "_MOUNTINFO", str(tmp_path / "absent"))
    assert filesystems.filesystem_of(str(tmp_path)) is None and filesystems.slow_filesystem_note(str(tmp_path)) is None


def _trace_file(path):
    import sglang_otel_kernels as sok

    sok.configure(level=1, log_dest="off", trace_file=str(path))
    try:
        sok.debug_kernel_api(op_name="fs.kernel")(lambda: None)()
    finally:
        sok.configure(trace_file="off")


def test_report_says_a_trace_file_on_a_network_filesystem_beside_its_report(mounts, capsys):
    from sglang_otel_kernels.__main__ import main

    said = {}
    for name, path in (("nfs", mounts / "models" / "t.sgltrace"), ("local", mounts / "local.sgltrace")):
        _trace_file(path)
        assert main(["report", str(path)]) == 0
        said[name] = capsys.readouterr()
    assert said["nfs"].out.splitlines()[0] == said["local"].out.splitlines()[0]  # the report itself is the same
    note = said["nfs"].err.strip()
    assert note.startswith(f"sglang-otel-kernels: {mounts / 'models'} is on NFS (nfs4), a network or FUSE filesystem")
    assert "SGLANG_KERNEL_API_TRACEFILE" in note
    assert "network" not in said["local"].err
