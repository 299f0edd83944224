/*
 * tenon-launch: start a process-backend sandbox, or run a command inside one.
 *
 *   tenon-launch start --id-base N --rootfs DIR --persist DIR --stage DIR --info-fd FD
 *                      --shm-bytes N --tmp-bytes N [--ro-bind HOST_PATH PATH]...
 *                      [--disposable PATH]...
 *   tenon-launch enter --pid N --uid N --gid N [--groups G,G...] [--root] --cwd DIR -- ARGV...
 *
 * start (run as host root): makes a net namespace (owned by the host's user namespace,
 * loopback up), then clones into new user, pid, mount, uts, ipc and cgroup namespaces. The user namespace maps 0..65535 to N..N+65535 and is owned by host uid N
 * (so a helper running as N, slirp4netns, may join it). The parent attaches the image
 * rootfs (read-only) and the persistent root as idmapped mounts of that namespace (files
 * stay in canonical ids on disk) and hands them to the child, which builds the root: an
 * overlay (image lower, persist/upper upper, persist/work work), the persistent
 * directories bound on top, a minimal /dev, /proc (its sys read-only), the read-only
 * binds asked for, disposable tmpfs;
 * every mount point is resolved beneath the new root without following symlinks and
 * mounted by fd. Then pivot_root, the old root detached, and the child becomes pid 1: a
 * reaper without capabilities under the seccomp filter. It prints "tenon-ready". The
 * parent writes {"child-pid": N} to the info fd and waits for pid 1; both die with their
 * parent (PR_SET_PDEATHSIG).
 *
 * enter (run as host root, already in the sandbox cgroup): joins every namespace of pid N
 * through its pidfd, forks (the child is in the sandbox's pid namespace), and the child
 * takes the uid, gid and groups given, keeps Docker's default capabilities if --root
 * (none otherwise; the bounding set is Docker's default for both), sets no_new_privs,
 * changes to the cwd, loads the seccomp filter last and execs. The parent outside reaps
 * it and exits as it did (same code, or the same signal).
 *
 * Exit codes of enter before exec: 125 the sandbox is gone, 126 setup failed, 127 no such
 * program. The seccomp BPF comes from tenon_seccomp_bpf.h (see sandbox/launcher.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <grp.h>
#include <net/if.h>
#include <sys/ioctl.h>

#include "tenon_seccomp_bpf.h" /* static const unsigned char tenon_bpf[] */

/* The net namespace is the parent's, made by host root before the clone: owned by the
 * host's user namespace, nothing inside the sandbox can change its rules. */
#define CLONE_FLAGS (CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | \
                     CLONE_NEWCGROUP)
#define NS_FLAGS (CLONE_FLAGS | CLONE_NEWNET)
#define ID_COUNT 65536
#define MAX_DISPOSABLE 32
#define MAX_BINDS 8
#define MAX_GROUPS 64

static const char *mode = "launch";

static void die(int code, const char *fmt, ...) {
    int err = errno;
    va_list ap;
    fprintf(stderr, "tenon-launch %s: ", mode);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, err ? ": %s\n" : "\n", strerror(err));
    exit(code);
}

/* Docker's default capability set (moby oci/caps/defaults.go). */
static const int docker_caps[] = {
    CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FSETID, CAP_FOWNER, CAP_MKNOD, CAP_NET_RAW, CAP_SETGID,
    CAP_SETUID, CAP_SETFCAP, CAP_SETPCAP, CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT, CAP_KILL,
    CAP_AUDIT_WRITE,
};

static unsigned long long docker_mask(void) {
    unsigned long long mask = 0;
    for (size_t i = 0; i < sizeof docker_caps / sizeof docker_caps[0]; i++)
        mask |= 1ULL << docker_caps[i];
    return mask;
}

/* Bounding set down to `keep`; permitted, effective and inheritable to `keep` as well. */
static void set_caps(unsigned long long bounding, unsigned long long keep) {
    for (int cap = 0; cap <= 63; cap++) {
        if (bounding & (1ULL << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
            die(126, "dropping capability %d from the bounding set", cap);
    }
    errno = 0;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    for (int i = 0; i < 2; i++) {
        unsigned int word = (unsigned int)(keep >> (32 * i));
        data[i].effective = data[i].permitted = data[i].inheritable = word;
    }
    if (syscall(SYS_capset, &hdr, data) != 0) die(126, "capset");
}

static void load_seccomp(void) {
    static struct sock_filter program[sizeof tenon_bpf / sizeof(struct sock_filter)];
    memcpy(program, tenon_bpf, sizeof program);
    struct sock_fprog filter = {.len = sizeof program / sizeof program[0], .filter = program};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die(126, "no_new_privs");
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter) != 0) die(126, "seccomp");
}

/* ---------------------------------------------------------------- mounts, by fd */

static int openat2_beneath(int dirfd, const char *name, int flags) {
    struct open_how how = {.flags = (unsigned long long)flags | O_CLOEXEC | O_NOFOLLOW,
                           .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH |
                                      RESOLVE_NO_MAGICLINKS};
    return (int)syscall(SYS_openat2, dirfd, name, &how, sizeof how);
}

/* An O_PATH fd of directory `path` beneath `rootfd`, each component created if missing;
 * a symlink anywhere on the way is an error, never followed. */
static int dir_beneath(int rootfd, const char *path) {
    char copy[4096];
    snprintf(copy, sizeof copy, "%s", path);
    int cur = dup(rootfd);
    if (cur < 0) die(1, "dup");
    char *save = NULL;
    for (char *part = strtok_r(copy, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        if (mkdirat(cur, part, 0755) != 0 && errno != EEXIST) die(1, "mkdir %s", path);
        int next = openat2_beneath(cur, part, O_PATH | O_DIRECTORY);
        if (next < 0) die(1, "mount point %s (a symlink is never followed)", path);
        close(cur);
        cur = next;
    }
    return cur;
}

/* An O_PATH fd of file `name` in directory fd `dirfd`, created empty if missing. */
static int file_beneath(int dirfd, const char *name) {
    int fd = openat(dirfd, name, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) close(fd);
    else if (errno != EEXIST) die(1, "creating mount point %s", name);
    fd = openat2_beneath(dirfd, name, O_PATH);
    if (fd < 0) die(1, "mount point %s (a symlink is never followed)", name);
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        errno = 0;
        die(1, "mount point %s is not a regular file (a symlink is never followed)", name);
    }
    return fd;
}

static void set_attr(int fd, unsigned long long set) {
    struct mount_attr attr = {.attr_set = set};
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0)
        die(1, "mount_setattr");
}

/* Bind a clone of `src_dir`/`src` onto the O_PATH fd `target` (closed). */
static void bind_fd(int src_dir, const char *src, int target, unsigned long long attrs) {
    int tree = (int)syscall(SYS_open_tree, src_dir, src,
                            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_SYMLINK_NOFOLLOW);
    if (tree < 0) die(1, "open_tree %s", src);
    if (attrs) set_attr(tree, attrs);
    if (syscall(SYS_move_mount, tree, "", target, "",
                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) != 0)
        die(1, "move_mount %s", src);
    close(tree);
    close(target);
}

/* mount(2) a new filesystem on the O_PATH fd `target` (closed). */
static void mount_fd(const char *fstype, int target, unsigned long flags, const char *data) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", target);
    if (mount(fstype, path, fstype, flags, data) != 0) die(1, "mounting %s", fstype);
    close(target);
}

struct start_args {
    unsigned long id_base;
    const char *rootfs, *persist, *stage;
    const char *binds[MAX_BINDS][2]; /* host path, sandbox path: read-only */
    int num_binds;
    int info_fd;
    unsigned long long shm_bytes, tmp_bytes;
    const char *disposable[MAX_DISPOSABLE];
    int num_disposable;
};

static const char *const persistent[][2] = {
    {"workspace", "workspace"}, {"home", "home/user"}, {"tmp", "tmp"},
};

static void make_dev(int rootfd, unsigned long long shm_bytes) {
    char opts[128];
    mount_fd("tmpfs", dir_beneath(rootfd, "dev"), MS_NOSUID | MS_NOEXEC, "size=64k,mode=755");
    int dev = dir_beneath(rootfd, "dev");
    static const char *const nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        char host[64];
        snprintf(host, sizeof host, "/dev/%s", nodes[i]);
        bind_fd(AT_FDCWD, host, file_beneath(dev, nodes[i]), 0);
    }
    mount_fd("devpts", dir_beneath(dev, "pts"), MS_NOSUID | MS_NOEXEC,
             "newinstance,ptmxmode=0666,mode=620");
    snprintf(opts, sizeof opts, "size=%llu,mode=1777", shm_bytes);
    mount_fd("tmpfs", dir_beneath(dev, "shm"), MS_NOSUID | MS_NODEV, opts);
    mount_fd("mqueue", dir_beneath(dev, "mqueue"), MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    static const char *const links[][2] = {
        {"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
        {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
    };
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        if (symlinkat(links[i][0], dev, links[i][1]) != 0) die(1, "symlink /dev/%s", links[i][1]);
    set_attr(dev, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC);
    close(dev);
}

/* Bind host path `src` (file or directory) read-only at `dst` (absolute) in the new root. */
static void bind_ro(int rootfd, const char *src, const char *dst) {
    struct stat st;
    if (stat(src, &st) != 0) die(1, "%s", src);
    int target;
    if (S_ISDIR(st.st_mode)) {
        target = dir_beneath(rootfd, dst + 1);
    } else {
        char parent[4096];
        snprintf(parent, sizeof parent, "%s", dst + 1);
        char *slash = strrchr(parent, '/');
        const char *name = slash ? slash + 1 : parent;
        if (slash) *slash = 0;
        int dir = slash ? dir_beneath(rootfd, parent) : dup(rootfd);
        target = file_beneath(dir, name);
        close(dir);
    }
    bind_fd(AT_FDCWD, src, target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
}

static void build_root(const struct start_args *a, int image_fd, int persist_fd) {
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) die(1, "making / private");
    if (mount("tmpfs", a->stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=700") != 0)
        die(1, "staging tmpfs on %s", a->stage);
    if (chdir(a->stage) != 0) die(1, "chdir %s", a->stage);
    static const char *const dirs[] = {"lower", "persist", "root"};
    for (size_t i = 0; i < 3; i++)
        if (mkdir(dirs[i], 0700) != 0) die(1, "mkdir %s", dirs[i]);
    if (syscall(SYS_move_mount, image_fd, "", AT_FDCWD, "lower", MOVE_MOUNT_F_EMPTY_PATH) != 0)
        die(1, "attaching the image rootfs");
    if (syscall(SYS_move_mount, persist_fd, "", AT_FDCWD, "persist",
                MOVE_MOUNT_F_EMPTY_PATH) != 0)
        die(1, "attaching the persistent root");
    if (mount("overlay", "root", "overlay", 0,
              "lowerdir=lower,upperdir=persist/upper,workdir=persist/work,userxattr,"
              "index=off,xino=off,metacopy=off,uuid=null") != 0)
        die(1, "overlay root");
    int rootfd = open("root", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int persistfd = open("persist", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0 || persistfd < 0) die(1, "opening the new root");
    for (size_t i = 0; i < sizeof persistent / sizeof persistent[0]; i++)
        bind_fd(persistfd, persistent[i][0], dir_beneath(rootfd, persistent[i][1]), 0);
    make_dev(rootfd, a->shm_bytes);
    int proc = dir_beneath(rootfd, "proc");
    mount_fd("proc", dup(proc), MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    close(proc);
    proc = dir_beneath(rootfd, "proc");
    bind_fd(proc, "sys", openat2_beneath(proc, "sys", O_PATH | O_DIRECTORY),
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC);
    close(proc);
    for (int i = 0; i < a->num_binds; i++)
        bind_ro(rootfd, a->binds[i][0], a->binds[i][1]);
    char opts[64];
    snprintf(opts, sizeof opts, "size=%llu,mode=1777", a->tmp_bytes);
    for (int i = 0; i < a->num_disposable; i++)
        mount_fd("tmpfs", dir_beneath(rootfd, a->disposable[i] + 1), MS_NOSUID | MS_NODEV, opts);
    if (fchdir(rootfd) != 0) die(1, "chdir to the new root");
    if (syscall(SYS_pivot_root, ".", ".") != 0) die(1, "pivot_root");
    if (umount2(".", MNT_DETACH) != 0) die(1, "detaching the old root");
    if (chdir("/") != 0) die(1, "chdir /");
    close(rootfd);
    close(persistfd);
}

/* Receive the two mount fds the parent made. */
static void recv_fds(int sock, int fds[2]) {
    char byte;
    struct iovec iov = {&byte, 1};
    union { char buf[CMSG_SPACE(2 * sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1) die(1, "the launcher parent is gone");
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(2 * sizeof(int))) {
        errno = 0;
        die(1, "no mount fds from the launcher parent");
    }
    memcpy(fds, CMSG_DATA(c), 2 * sizeof(int));
}

static void send_fds(int sock, const int fds[2]) {
    char byte = 'm';
    struct iovec iov = {&byte, 1};
    union { char buf[CMSG_SPACE(2 * sizeof(int))]; struct cmsghdr align; } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    memcpy(CMSG_DATA(c), fds, 2 * sizeof(int));
    if (sendmsg(sock, &msg, 0) != 1) die(1, "handing the mounts to the sandbox");
}

static void reap_forever(int sock) {
    /* SIGCHLD blocked is queued, not ignored: sigwaitinfo wakes for each orphan's death. */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, NULL) != 0) die(1, "sigprocmask");
    set_caps(0, 0);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    load_seccomp();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) die(1, "pdeathsig");
    struct pollfd p = {sock, POLLRDHUP, 0};
    if (poll(&p, 1, 0) != 0) _exit(1); /* the parent died before pdeathsig was set */
    if (write(STDOUT_FILENO, "tenon-ready\n", 12) != 12) _exit(1);
    int null = open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3; fd++) dup2(null, fd);
    if (null > 2) close(null);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        sigwaitinfo(&chld, NULL);
    }
}

static int idmapped(const char *path, int userns, unsigned long long attrs) {
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, path,
                            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_SYMLINK_NOFOLLOW);
    if (tree < 0) die(1, "open_tree %s", path);
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_IDMAP | attrs,
                              .userns_fd = (unsigned long long)userns};
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0)
        die(1, "idmapping %s", path);
    return tree;
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) die(1, "%s", path);
    close(fd);
}

static int start(const struct start_args *a) {
    pid_t controller = getppid();
    if (unshare(CLONE_NEWNET) != 0) die(1, "new network namespace");
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq lo = {.ifr_name = "lo"};
    if (sock < 0 || ioctl(sock, SIOCGIFFLAGS, &lo) != 0) die(1, "reading lo");
    lo.ifr_flags |= IFF_UP;
    if (ioctl(sock, SIOCSIFFLAGS, &lo) != 0) die(1, "bringing lo up");
    close(sock);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) die(1, "socketpair");
    /* The user namespace's owner is the euid at clone: the range's first host uid. */
    if (setresuid(-1, (uid_t)a->id_base, -1) != 0) die(1, "seteuid %lu", a->id_base);
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_FLAGS | SIGCHLD, 0, 0, 0, 0);
    if (pid < 0) die(1, "clone");
    if (pid == 0) {
        close(sv[0]);
        int fds[2];
        recv_fds(sv[1], fds);
        if (setresgid(0, 0, 0) != 0 || setresuid(0, 0, 0) != 0 || setgroups(0, NULL) != 0)
            die(1, "becoming root in the user namespace");
        if (sethostname("sandbox", 7) != 0) die(1, "sethostname");
        build_root(a, fds[0], fds[1]);
        reap_forever(sv[1]);
    }
    close(sv[1]);
    if (setresuid(-1, 0, -1) != 0) die(1, "seteuid 0");
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) die(1, "pdeathsig");
    if (getppid() != controller) { kill(pid, SIGKILL); _exit(1); }
    char path[64], map[64];
    snprintf(map, sizeof map, "0 %lu %d\n", a->id_base, ID_COUNT);
    snprintf(path, sizeof path, "/proc/%d/uid_map", pid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/gid_map", pid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
    int userns = open(path, O_RDONLY | O_CLOEXEC);
    if (userns < 0) die(1, "%s", path);
    int fds[2] = {idmapped(a->rootfs, userns, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV),
                  idmapped(a->persist, userns, MOUNT_ATTR_NODEV)};
    /* Before the child gets its mounts: it prints the ready line only after building its
     * root from them, so the controller, which reads this once it saw that line, finds it
     * there however the two are scheduled. */
    dprintf(a->info_fd, "{\"child-pid\": %d}\n", pid);
    close(a->info_fd);
    send_fds(sv[0], fds);
    close(fds[0]);
    close(fds[1]);
    close(userns);
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) die(1, "waitpid");
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* ---------------------------------------------------------------- enter */

struct enter_args {
    pid_t pid;
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_GROUPS];
    int num_groups;
    int root;
    const char *cwd;
    char **argv;
};

static int enter(const struct enter_args *a) {
    int pidfd = (int)syscall(SYS_pidfd_open, a->pid, 0);
    if (pidfd < 0) die(125, "the sandbox (pid %d) is gone", a->pid);
    /* The user namespace last: with its credentials, root could not join the network
     * namespace the host's user namespace owns. */
    if (setns(pidfd, NS_FLAGS & ~CLONE_NEWUSER) != 0 || setns(pidfd, CLONE_NEWUSER) != 0)
        die(125, "joining the namespaces of pid %d", a->pid);
    close(pidfd);
    pid_t child = fork();
    if (child < 0) die(126, "fork");
    if (child == 0) {
        unsigned long long keep = a->root ? docker_mask() : 0;
        for (int cap = 0; cap <= 63; cap++)
            if (!(docker_mask() & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 &&
                errno != EINVAL)
                die(126, "bounding set");
        if (setgroups((size_t)a->num_groups, a->groups) != 0) die(126, "setgroups");
        if (setresgid(a->gid, a->gid, a->gid) != 0) die(126, "setgid %u", a->gid);
        if (setresuid(a->uid, a->uid, a->uid) != 0) die(126, "setuid %u", a->uid);
        set_caps(docker_mask(), keep);
        if (chdir(a->cwd) != 0) die(126, "cwd %s", a->cwd);
        load_seccomp();
        execvp(a->argv[0], a->argv);
        die(errno == ENOENT ? 127 : 126, "%s", a->argv[0]);
    }
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) die(126, "waitpid");
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    signal(WTERMSIG(status), SIG_DFL);
    kill(getpid(), WTERMSIG(status));
    return 128 + WTERMSIG(status);
}

/* ---------------------------------------------------------------- arguments */

static unsigned long long number(const char *flag, const char *text) {
    char *end;
    errno = 0;
    unsigned long long n = strtoull(text, &end, 10);
    if (errno || *end || !*text) die(2, "%s: not a number: %s", flag, text);
    return n;
}

static int parse_groups(const char *text, gid_t *out) {
    int n = 0;
    char copy[1024], *save = NULL;
    snprintf(copy, sizeof copy, "%s", text);
    for (char *g = strtok_r(copy, ",", &save); g; g = strtok_r(NULL, ",", &save)) {
        if (n == MAX_GROUPS) die(2, "--groups: more than %d", MAX_GROUPS);
        out[n++] = (gid_t)number("--groups", g);
    }
    return n;
}

int main(int argc, char **argv) {
    if (argc < 2) die(2, "usage: tenon-launch start|enter ...");
    mode = argv[1];
    if (strcmp(mode, "start") == 0) {
        struct start_args a = {.info_fd = -1};
        for (int i = 2; i + 1 < argc; i += 2) {
            const char *f = argv[i], *v = argv[i + 1];
            if (!strcmp(f, "--ro-bind") && i + 2 < argc && a.num_binds < MAX_BINDS &&
                argv[i + 2][0] == '/') {
                a.binds[a.num_binds][0] = v;
                a.binds[a.num_binds++][1] = argv[++i + 1];
            } else if (!strcmp(f, "--id-base")) a.id_base = number(f, v);
            else if (!strcmp(f, "--rootfs")) a.rootfs = v;
            else if (!strcmp(f, "--persist")) a.persist = v;
            else if (!strcmp(f, "--stage")) a.stage = v;
            else if (!strcmp(f, "--info-fd")) a.info_fd = (int)number(f, v);
            else if (!strcmp(f, "--shm-bytes")) a.shm_bytes = number(f, v);
            else if (!strcmp(f, "--tmp-bytes")) a.tmp_bytes = number(f, v);
            else if (!strcmp(f, "--disposable") && a.num_disposable < MAX_DISPOSABLE &&
                     v[0] == '/')
                a.disposable[a.num_disposable++] = v;
            else die(2, "bad argument %s %s", f, v);
        }
        if (!a.id_base || !a.rootfs || !a.persist || !a.stage || a.info_fd < 0)
            die(2, "--id-base, --rootfs, --persist, --stage and --info-fd are required");
        return start(&a);
    }
    if (strcmp(mode, "enter") == 0) {
        struct enter_args a = {.cwd = "/"};
        int i = 2;
        for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
            const char *f = argv[i];
            if (!strcmp(f, "--root")) { a.root = 1; continue; }
            if (i + 1 >= argc) die(2, "%s needs a value", f);
            const char *v = argv[++i];
            if (!strcmp(f, "--pid")) a.pid = (pid_t)number(f, v);
            else if (!strcmp(f, "--uid")) a.uid = (uid_t)number(f, v);
            else if (!strcmp(f, "--gid")) a.gid = (gid_t)number(f, v);
            else if (!strcmp(f, "--groups")) a.num_groups = parse_groups(v, a.groups);
            else if (!strcmp(f, "--cwd")) a.cwd = v;
            else die(2, "bad argument %s", f);
        }
        if (i + 1 >= argc || a.pid <= 0) die(2, "usage: enter --pid N ... -- PROGRAM [ARG]...");
        a.argv = argv + i + 1;
        return enter(&a);
    }
    die(2, "unknown mode %s (start or enter)", mode);
}
