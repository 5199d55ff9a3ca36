"""The seccomp filter of the sandbox (pipeline/eval/sandbox.py): the system calls that would let a program hold
memory outside its address-space limit, or reach a unix socket, are refused with EPERM.

    program(machine) -> bytes     # the classic-BPF program (struct sock_filter[]) for this CPU architecture
    LAUNCHER                      # python -I -S -c LAUNCHER <program hex> <code>: installs it, then execs
                                  # python -I -S -c <code> (a filter survives execve and cannot be removed)

Refused: memfd_create and memfd_secret (memory files: RLIMIT_FSIZE caps each one, not their number), shmget,
msgget and semget (SysV IPC: segments and queues are not mapped, so RLIMIT_AS does not count them; the sandbox's
IPC namespace also drops whatever exists when it ends), io_uring_setup (its operations are not seen by seccomp:
socket and connect through it would pass), and socket/socketpair of AF_UNIX (a read-only mount does not stop a
connect() to a socket file; abstract sockets are already per network namespace). POSIX shared memory is a file in
/dev/shm, which the sandbox mounts read-only. Another architecture's system calls (i386 on x86_64, x32) kill the
process or are refused. With these, a program's memory is its address space (RLIMIT_AS) plus its /tmp tmpfs plus
kernel buffers bounded by its file-descriptor limit.
"""
from __future__ import annotations

import struct

AF_UNIX = 1
EPERM = 1
_LD_W_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_X32_BIT = 0x40000000

# arch: (AUDIT_ARCH_*, {refused call: nr}, {socket call: nr})
_ARCHES = {
    "x86_64": (0xC000003E, {"memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64,
                            "io_uring_setup": 425}, {"socket": 41, "socketpair": 53}),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190,
                             "io_uring_setup": 425}, {"socket": 198, "socketpair": 199}),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported(machine: str) -> bool:
    return machine in _ARCHES


def program(machine: str) -> bytes:
    """The filter for `machine` (platform.machine()): KeyError for an architecture without a table."""
    arch, refused, sockets = _ARCHES[machine]
    deny = _op(_RET, _ERRNO | EPERM)
    ops = [_op(_LD_W_ABS, 4), _op(_JEQ, arch, 1, 0), _op(_RET, _KILL),  # seccomp_data.arch
           _op(_LD_W_ABS, 0)]                                           # seccomp_data.nr
    if machine == "x86_64":
        ops += [_op(_JGE, _X32_BIT, 0, 1), deny]
    for nr in refused.values():
        ops += [_op(_JEQ, nr, 0, 1), deny]
    for nr in sockets.values():  # args[0] (the domain): its low 32 bits, little-endian
        ops += [_op(_JEQ, nr, 0, 4), _op(_LD_W_ABS, 16), _op(_JEQ, AF_UNIX, 0, 1), deny, _op(_RET, _ALLOW)]
    ops.append(_op(_RET, _ALLOW))
    return b"".join(ops)


# Runs in the sandbox (python -I -S, the emptied environment): argv[1] the program in hex, argv[2] the code.
LAUNCHER = r"""import ctypes, os, sys
prog = bytes.fromhex(sys.argv[1])
buf = ctypes.create_string_buffer(prog, len(prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):  # NO_NEW_PRIVS, SECCOMP filter
    sys.stderr.write("sandbox: the seccomp filter was refused: " + os.strerror(ctypes.get_errno()) + "\n")
    sys.exit(96)
code = sys.argv[2]
del prog, buf, fprog, libc
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", code])
"""
