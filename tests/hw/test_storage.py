"""Runs-root filesystem from a fake /proc/mounts, and the node-local NVMe probe on tmp_path."""

from __future__ import annotations

import os

import pytest

from embodyhpc.hw.checks import Status, human_bytes
from embodyhpc.hw.storage import (
    NvmeInfo,
    check_nvme,
    check_runs_root,
    probe_nvme,
    probe_write_mb_s,
)
from embodyhpc.mounts import mount_for, read_mounts

PROC_MOUNTS = """\
overlay / overlay rw,relatime,lowerdir=/var/lib/containers/l/ABC,upperdir=/var/lib/containers/u,workdir=/w 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=1056964608k 0 0
/dev/nvme0n1p2 /boot ext4 rw,relatime 0 0
/dev/md0 /local/nvme xfs rw,noatime,attr2,inode64,logbufs=8,logbsize=32k,sunit=1024,swidth=4096,noquota 0 0
10.10.0.1@o2ib,10.10.0.2@o2ib:/scratch /lustre lustre rw,flock,lazystatfs,encrypt 0 0
10.10.0.3@o2ib:/proj /lustre/proj lustre rw,flock,lazystatfs 0 0
gpfs0 /gpfs/fs0 gpfs rw,relatime 0 0
nas01:/export/home /home nfs4 rw,relatime,vers=4.2,rsize=1048576,wsize=1048576,hard,proto=tcp 0 0
nas02:/vol/old /mnt/old nfs rw,relatime,vers=3,hard,proto=tcp 0 0
beegfs_nodev /mnt/beegfs beegfs rw,relatime,cfgFile=/etc/beegfs/beegfs-client.conf 0 0
default /mnt/weka wekafs rw,relatime,writecache,inode_bits=auto,dentry_max_age_positive=1000 0 0
/dev/sdb1 /mnt/with\\040space ext4 rw,relatime 0 0
/dev/sdc1 /mnt/stacked ext4 rw,relatime 0 0
nas03:/stack /mnt/stacked nfs4 rw,relatime 0 0
s3fs /mnt/bucket fuse.s3fs rw,nosuid,nodev,relatime,user_id=0,group_id=0 0 0
"""


@pytest.fixture
def mounts(tmp_path):
    path = tmp_path / "mounts"
    path.write_text(PROC_MOUNTS)
    return read_mounts(path)


@pytest.mark.parametrize("path, mount_point, kind", [
    ("/lustre/scratch/runs/pi05", "/lustre", "lustre"),
    ("/lustre/proj/runs", "/lustre/proj", "lustre"),
    ("/lustre/projects/x", "/lustre", "lustre"),  # a prefix of the name is not a parent folder
    ("/gpfs/fs0/ckpt", "/gpfs/fs0", "gpfs"),
    ("/home/alice/runs", "/home", "nfs"),
    ("/mnt/old", "/mnt/old", "nfs"),
    ("/mnt/beegfs/runs", "/mnt/beegfs", "beegfs"),
    ("/mnt/weka/runs", "/mnt/weka", "weka"),
    ("/local/nvme/stage", "/local/nvme", "local"),
    ("/dev/shm/x", "/dev/shm", "local"),
    ("/mnt/with space/runs", "/mnt/with space", "local"),
    ("/mnt/stacked/runs", "/mnt/stacked", "nfs"),  # the later mount on the same point hides the earlier one
    ("/mnt/bucket/runs", "/mnt/bucket", "other"),
    ("/opt/runs", "/", "local"),
])
def test_longest_mount_point_wins_and_is_classified(mounts, path, mount_point, kind):
    mount = mount_for(path, mounts)
    assert (mount.mount_point, mount.kind) == (mount_point, kind)


def test_runs_root_verdicts(mounts):
    assert check_runs_root("/lustre/runs", mounts, num_nodes=16)[1].status is Status.OK
    nfs = check_runs_root("/home/alice/runs", mounts, num_nodes=4)[1]
    assert nfs.status is Status.WARN and "nfs4" in nfs.reason
    assert check_runs_root("/home/alice/runs", mounts, num_nodes=1)[1].status is Status.OK
    local = check_runs_root("/local/nvme/runs", mounts, num_nodes=2)[1]
    assert local.status is Status.FAIL and "not shared" in local.reason and "2-node job" in local.reason
    assert check_runs_root("/local/nvme/runs", mounts, num_nodes=1)[1].status is Status.OK
    assert check_runs_root("/opt/runs", mounts)[1].status is Status.WARN  # the container's overlay
    assert check_runs_root("/x", [])[1].status is Status.WARN


def test_nvme_probe_writes_measures_and_cleans_up(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    mounts_file = tmp_path / "mounts"
    mounts_file.write_text(f"/dev/nvme1n1 {os.path.realpath(nvme)} xfs rw,noatime 0 0\n")
    info = probe_nvme(nvme, read_mounts(mounts_file), probe_bytes=1 << 20)
    assert info.exists and info.fstype == "xfs" and info.kind == "local"
    assert info.free_bytes > 0 and info.total_bytes >= info.free_bytes and info.write_mb_s > 0
    assert list(nvme.iterdir()) == []
    checks = check_nvme(info, required_bytes=1, min_write_mb_s=0.001)
    assert [c.status for c in checks] == [Status.OK] and "MB/s" in checks[0].reason


def test_nvme_verdicts():
    full = check_nvme(NvmeInfo("/local/nvme", True, free_bytes=3_100_000_000, total_bytes=3_840_000_000_000),
                      required_bytes=120_000_000_000)
    assert [c.status for c in full] == [Status.FAIL]
    assert full[0].reason == "NVMe /local/nvme has 3.1 GB free, staging needs 120.0 GB"
    missing = check_nvme(NvmeInfo("/local/nvme", exists=False))
    assert missing[0].status is Status.FAIL and "does not exist" in missing[0].reason
    slow = check_nvme(NvmeInfo("/local/nvme", True, free_bytes=10**12, total_bytes=10**12, write_mb_s=80.0))
    assert [c.status for c in slow] == [Status.WARN] and "80 MB/s" in slow[0].reason
    remote = check_nvme(NvmeInfo("/scratch", True, free_bytes=10**12, total_bytes=10**12, fstype="lustre",
                                 kind="lustre"))
    assert remote[0].status is Status.WARN and "not a node-local disk" in remote[0].reason


def test_probe_skipped_and_missing_path(tmp_path):
    assert probe_nvme(tmp_path, [], probe_bytes=0).write_mb_s is None
    assert not probe_nvme(tmp_path / "absent", [], probe_bytes=1).exists
    assert probe_write_mb_s(tmp_path, 1000, chunk_bytes=64) > 0


def test_human_bytes_is_decimal():
    assert (human_bytes(999), human_bytes(3_100_000_000), human_bytes(2.5e13)) == ("999 B", "3.1 GB", "25.0 TB")
