/*
 * tenon-seccomp-exec: load Tenon's default seccomp filter, then exec argv[1..].
 *
 * Every process of a process-backend sandbox starts through this helper (the init and each
 * action, after nsenter has joined the sandbox's namespaces: a filter that denies setns
 * could not be loaded before). The filter is an allowlist with the same syscalls and
 * argument rules as Docker's default profile for a container without capabilities
 * (moby profiles/seccomp/default.json); everything else fails with EPERM, except that
 * clone3 and syscalls newer than that profile (numbers from FIRST_UNKNOWN_NR, shared by
 * all architectures since Linux 5.1) fail with ENOSYS, the answer a C library expects from
 * an older kernel before falling back (clone3 to clone, whose namespace flags are denied;
 * fchmodat2 to fchmodat). Only the native architecture is allowed: a 32-bit or x32
 * syscall kills the process.
 *
 * Built in two stages by `python -m tenon.sandbox.seccomp build` (scripts/setup.sh runs it):
 * compiled with TENON_SECCOMP_GENERATE and libseccomp, this program writes the filter's
 * BPF to stdout; the builder turns that into tenon_seccomp_bpf.h, and the helper proper is
 * this file compiled statically without it: it loads the ready BPF with prctl(2) and
 * execs, so a sandbox process pays for no filter compilation (libseccomp takes ~4 ms to
 * build the filter) and the sandbox's rootfs needs no libseccomp.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int fail(const char *what, int err) {
    fprintf(stderr, "tenon-seccomp-exec: %s: %s\n", what, strerror(err));
    return 126;
}

#ifdef TENON_SECCOMP_GENERATE
#include <seccomp.h>

static const char *const allowed[] = {
    "accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk", "capget", "capset",
    "chdir", "chmod", "chown", "clock_adjtime", "clock_getres", "clock_gettime",
    "clock_nanosleep", "close", "close_range", "connect", "copy_file_range", "creat", "dup",
    "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old",
    "epoll_pwait", "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2",
    "execve", "execveat", "exit", "exit_group", "faccessat", "faccessat2", "fadvise64",
    "fallocate", "fanotify_mark", "fchdir", "fchmod", "fchmodat", "fchown", "fchownat",
    "fcntl", "fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr",
    "fsetxattr", "fstat", "fstatfs", "fsync", "ftruncate", "futex", "futex_waitv",
    "futimesat", "getcpu", "getcwd", "getdents", "getdents64", "getegid", "geteuid", "getgid",
    "getgroups", "getitimer", "getpeername", "getpgid", "getpgrp", "getpid", "getppid",
    "getpriority", "getrandom", "getresgid", "getresuid", "getrlimit", "get_robust_list",
    "getrusage", "getsid", "getsockname", "getsockopt", "get_thread_area", "gettid",
    "gettimeofday", "getuid", "getxattr", "inotify_add_watch", "inotify_init",
    "inotify_init1", "inotify_rm_watch", "io_cancel", "ioctl", "io_destroy", "io_getevents",
    "io_pgetevents", "ioprio_get", "ioprio_set", "io_setup", "io_submit", "io_uring_enter",
    "io_uring_register", "io_uring_setup", "kill", "landlock_add_rule",
    "landlock_create_ruleset", "landlock_restrict_self", "lchown", "lgetxattr", "link",
    "linkat", "listen", "listxattr", "llistxattr", "lremovexattr", "lseek", "lsetxattr",
    "lstat", "madvise", "membarrier", "memfd_create", "memfd_secret", "mincore", "mkdir",
    "mkdirat", "mknod", "mknodat", "mlock", "mlock2", "mlockall", "mmap", "mprotect",
    "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink",
    "mremap", "msgctl", "msgget", "msgrcv", "msgsnd", "msync", "munlock", "munlockall",
    "munmap", "name_to_handle_at", "nanosleep", "newfstatat", "open", "openat", "openat2",
    "pause", "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free",
    "pkey_mprotect", "poll", "ppoll", "prctl", "pread64", "preadv", "preadv2", "prlimit64",
    "process_mrelease", "pselect6", "pwrite64", "pwritev", "pwritev2", "read", "readahead",
    "readlink", "readlinkat", "readv", "recvfrom", "recvmmsg", "recvmsg", "remap_file_pages",
    "removexattr", "rename", "renameat", "renameat2", "restart_syscall", "rmdir", "rseq",
    "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn",
    "rt_sigsuspend", "rt_sigtimedwait", "rt_tgsigqueueinfo", "sched_getaffinity",
    "sched_getattr", "sched_getparam", "sched_get_priority_max", "sched_get_priority_min",
    "sched_getscheduler", "sched_rr_get_interval", "sched_setaffinity", "sched_setattr",
    "sched_setparam", "sched_setscheduler", "sched_yield", "seccomp", "select", "semctl",
    "semget", "semop", "semtimedop", "sendfile", "sendmmsg", "sendmsg", "sendto", "setfsgid",
    "setfsuid", "setgid", "setgroups", "setitimer", "setpgid", "setpriority", "setregid",
    "setresgid", "setresuid", "setreuid", "setrlimit", "set_robust_list", "setsid",
    "setsockopt", "set_thread_area", "set_tid_address", "setuid", "setxattr", "shmat",
    "shmctl", "shmdt", "shmget", "shutdown", "sigaltstack", "signalfd", "signalfd4",
    "socketpair", "splice", "stat", "statfs", "statx", "symlink", "symlinkat", "sync",
    "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time", "timer_create",
    "timer_delete", "timer_getoverrun", "timer_gettime", "timer_settime", "timerfd_create",
    "timerfd_gettime", "timerfd_settime", "times", "tkill", "truncate", "umask", "uname",
    "unlink", "unlinkat", "utime", "utimensat", "utimes", "vfork", "vmsplice", "wait4",
    "waitid", "write", "writev",
    /* Docker allows these from kernel 4.8 on (ptrace can no longer bypass seccomp). */
    "ptrace", "process_vm_readv", "process_vm_writev",
    /* x86-64 only, allowed by Docker there. */
    "arch_prctl", "modify_ldt",
};

/* personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26, UNAME26|PER_LINUX32,
 * and 0xffffffff (a query). */
static const unsigned long personalities[] = {0x0, 0x8, 0x20000, 0x20008, 0xffffffff};

/* CLONE_NEWNS|CLONE_NEWCGROUP|CLONE_NEWUTS|CLONE_NEWIPC|CLONE_NEWUSER|CLONE_NEWPID|CLONE_NEWNET */
#define NAMESPACE_FLAGS 0x7E020000UL
#define AF_VSOCK_FAMILY 40
/* Syscall numbers after set_mempolicy_home_node (450), the newest the profile knows, up to
 * a bound well past today's kernels. */
#define FIRST_UNKNOWN_NR 451
#define LAST_UNKNOWN_NR 511

int main(void) {
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ERRNO(EPERM));
    if (ctx == NULL) return fail("seccomp_init", ENOMEM);
    int rc;
    for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++) {
        int nr = seccomp_syscall_resolve_name(allowed[i]);
        if (nr == __NR_SCMP_ERROR) continue; /* not a syscall of this architecture */
        if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0)) < 0) return fail(allowed[i], -rc);
    }
    for (size_t i = 0; i < sizeof personalities / sizeof personalities[0]; i++) {
        rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(personality), 1,
                              SCMP_A0(SCMP_CMP_EQ, personalities[i]));
        if (rc < 0) return fail("personality", -rc);
    }
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(socket), 1,
                               SCMP_A0(SCMP_CMP_NE, AF_VSOCK_FAMILY))) < 0)
        return fail("socket", -rc);
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(clone), 1,
                               SCMP_A0(SCMP_CMP_MASKED_EQ, NAMESPACE_FLAGS, 0))) < 0)
        return fail("clone", -rc);
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0)) < 0)
        return fail("clone3", -rc);
    for (int nr = FIRST_UNKNOWN_NR; nr <= LAST_UNKNOWN_NR; nr++)
        if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), nr, 0)) < 0)
            return fail("newer syscalls", -rc);
    if ((rc = seccomp_export_bpf(ctx, STDOUT_FILENO)) < 0) return fail("export", -rc);
    seccomp_release(ctx);
    return 0;
}

#else /* the helper proper */
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>

#include "tenon_seccomp_bpf.h" /* static const unsigned char tenon_bpf[]: the exported BPF */

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: tenon-seccomp-exec PROGRAM [ARG]...\n");
        return 126;
    }
    static struct sock_filter program[sizeof tenon_bpf / sizeof(struct sock_filter)];
    memcpy(program, tenon_bpf, sizeof program);
    struct sock_fprog filter = {.len = sizeof program / sizeof program[0], .filter = program};
    /* Without no_new_privs only a privileged process may load a filter; set it regardless. */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail("no_new_privs", errno);
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter) != 0) return fail("seccomp", errno);
    execvp(argv[1], argv + 1);
    int err = errno;
    fail(argv[1], err);
    return err == ENOENT ? 127 : 126;
}
#endif
