"""The seccomp profile's shape: what runc 1.1 reads from ``linux.seccomp`` (OCI runtime spec, config-linux.md)."""

from __future__ import annotations

import os
from pathlib import Path

from sbx.runtime import seccomp
from sbx.runtime.oci import MASKED_PATHS, ContainerSpec, build_config, mount_targets


def _rules(profile: dict) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    by_name: dict[str, list[dict]] = {}  # type: ignore[type-arg]
    for rule in profile["syscalls"]:
        for name in rule["names"]:
            by_name.setdefault(name, []).append(rule)
    return by_name


def test_allow_by_default_for_three_x86_abis() -> None:
    p = seccomp.default_profile()
    assert p["defaultAction"] == "SCMP_ACT_ALLOW"
    assert p["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    # every rule refuses (an allow rule under an allow default is an error for libseccomp)
    assert {r["action"] for r in p["syscalls"]} == {"SCMP_ACT_ERRNO"}


def test_denied_calls_get_eperm_or_enosys_whatever_their_arguments() -> None:
    rules = _rules(seccomp.default_profile())
    for name in ("keyctl", "add_key", "request_key"):
        [rule] = rules[name]
        assert (rule["errnoRet"], rule.get("args")) == (38, None), name
    for name in ("bpf", "perf_event_open", "userfaultfd", "kexec_load",
                 "kexec_file_load", "open_by_handle_at", "io_uring_setup", "io_uring_enter", "io_uring_register",
                 "init_module", "finit_module", "delete_module", "acct", "swapon", "swapoff", "settimeofday",
                 "clock_settime", "lookup_dcookie", "syslog", "iopl", "ioperm"):
        [rule] = rules[name]
        assert (rule["errnoRet"], rule.get("args")) == (1, None), name


def test_new_user_namespaces_matched_on_the_flag_bit_and_clone3_enosys() -> None:
    rules = _rules(seccomp.default_profile())
    for name in ("clone", "unshare"):
        [rule] = rules[name]
        assert rule["errnoRet"] == 1
        assert rule["args"] == [{"index": 0, "value": 0x10000000, "valueTwo": 0x10000000,
                                 "op": "SCMP_CMP_MASKED_EQ"}]
    [rule] = rules["clone3"]
    assert (rule["errnoRet"], rule.get("args")) == (38, None)


def test_what_systemd_docker_and_criu_need_is_not_listed() -> None:
    rules = _rules(seccomp.default_profile())
    for name in ("reboot", "seccomp", "prctl", "mount", "umount2", "pivot_root", "setns", "ptrace", "adjtimex",
                 "name_to_handle_at"):
        assert name not in rules, name


def test_build_config_carries_the_profile_and_masks() -> None:
    cfg = build_config(ContainerSpec(hostname="h", memory_bytes=1 << 28, vcpus=1, cpuset_cpus="0",
                                     cgroup_path="/sbx/n/sb_x"))
    assert cfg["linux"]["seccomp"] == seccomp.default_profile()
    masked = cfg["linux"]["maskedPaths"]
    assert masked == MASKED_PATHS
    for path in ("/proc/cmdline", "/sys/block", "/sys/class/block", "/sys/dev/block", "/sys/devices/virtual/block",
                 "/sys/kernel/debug", "/proc/kcore"):
        assert path in masked
    # the sandbox's own net.* sysctls stay writable: /proc/sys is not made read-only as a whole
    assert "/proc/sys" not in cfg["linux"]["readonlyPaths"]


def test_sysfs_masks_are_binds_of_an_empty_dir_when_given_one(tmp_path: Path) -> None:
    """With a mask dir, each masked directory under /sys that exists on this host is a read-only bind of it (no
    tmpfs for CRIU to tar at every dump and restore); files and /proc paths stay runc masks."""
    empty = tmp_path / "masked"
    empty.mkdir()
    cfg = build_config(ContainerSpec(hostname="h", memory_bytes=1 << 28, vcpus=1, cpuset_cpus="0",
                                     cgroup_path="/sbx/n/sb_x", mask_dir=str(empty)))
    binds = [m for m in cfg["mounts"] if m.get("source") == str(empty)]
    dirs = [p for p in MASKED_PATHS if p.startswith("/sys/") and os.path.isdir(p)]
    assert [m["destination"] for m in binds] == dirs
    assert "/sys/block" in dirs  # this host has one, and it is what names every sandbox's disk
    for m in binds:
        assert m["type"] == "bind" and {"ro", "nosuid", "nodev", "noexec"} <= set(m["options"])
    masked = cfg["linux"]["maskedPaths"]
    assert sorted(masked + dirs) == sorted(MASKED_PATHS)
    assert "/proc/cmdline" in masked and "/proc/acpi" in masked and "/sys/kernel/vmcoreinfo" in masked
    names = [m["destination"] for m in cfg["mounts"]]
    assert names.index("/sys/block") > names.index("/sys")  # over the sandbox's sysfs
    # runc's restore makes bind targets on the disk itself (covered by sysfs later): precreated for it
    targets = dict(mount_targets(cfg))
    assert targets["/sys/block"] is False and "/sys/fs/cgroup" not in targets
