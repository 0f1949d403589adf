"""A seccomp filter as classic BPF bytes: pure data, built once, tested by evaluating it.

Stdlib only (it is also imported inside the kernel). The program checks the architecture first
(a 32-bit or x32 system call ABI would number syscalls differently, so any foreign ABI is
refused outright), then refuses the listed syscalls, and refuses ``socket()`` for the listed
address families. Everything else is allowed: this narrows a sandbox, it is not the sandbox.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1


@dataclass(frozen=True)
class Arch:
    audit: int  # AUDIT_ARCH_* as seccomp reports it
    seccomp: int  # the seccomp(2) syscall itself
    socket: int
    keyctl: int
    add_key: int
    request_key: int
    io_uring_setup: int  # io_uring can create sockets without socket(2): refused with it


ARCHES = {
    "x86_64": Arch(0xC000003E, 317, 41, 250, 248, 249, 425),
    "aarch64": Arch(0xC00000B7, 277, 198, 219, 217, 218, 425),
}


def native() -> Arch | None:
    return ARCHES.get(platform.machine())


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def program(arch: Arch, *, deny_unix_sockets: bool, deny_keyring: bool = True) -> bytes:
    """The filter: ``EPERM`` for denied syscalls, ``EACCES`` for ``socket(AF_UNIX, …)``."""
    eperm = RET_ERRNO | errno.EPERM
    denied = [arch.io_uring_setup] if deny_unix_sockets else []
    if deny_keyring:
        denied += [arch.keyctl, arch.add_key, arch.request_key]
    insns = [
        _insn(LD_W_ABS, 0, 0, OFF_ARCH),
        _insn(JEQ_K, 1, 0, arch.audit),
        _insn(RET_K, 0, 0, eperm),  # a foreign system call ABI
        _insn(LD_W_ABS, 0, 0, OFF_NR),
    ]
    if arch.audit == ARCHES["x86_64"].audit:
        insns += [_insn(JGE_K, 0, 1, X32_SYSCALL_BIT), _insn(RET_K, 0, 0, eperm)]
    for nr in denied:
        insns += [_insn(JEQ_K, 0, 1, nr), _insn(RET_K, 0, 0, eperm)]
    if deny_unix_sockets:
        insns += [
            _insn(JEQ_K, 0, 3, arch.socket),
            _insn(LD_W_ABS, 0, 0, OFF_ARG0),  # the domain (an int: the low 32 bits)
            _insn(JEQ_K, 0, 1, AF_UNIX),
            _insn(RET_K, 0, 0, RET_ERRNO | errno.EACCES),
        ]
    insns.append(_insn(RET_K, 0, 0, RET_ALLOW))
    return b"".join(insns)


def evaluate(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """Run the filter on one system call (for tests): the SECCOMP_RET_* value it returns."""
    data = struct.pack("iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    acc, pc = 0, 0
    insns = [struct.unpack("HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == LD_W_ABS:
            acc = struct.unpack_from("I", data, k)[0]
        elif code == JEQ_K:
            pc += jt if acc == k else jf
        elif code == JGE_K:
            pc += jt if acc >= k else jf
        elif code == RET_K:
            return int(k)
        else:
            raise ValueError(f"unknown BPF instruction {code:#x}")
