/* tenon-treewalk: list a directory tree's metadata without reading any file.
 *
 * usage: tenon-treewalk ROOT [SKIP...]
 *
 * Writes one record per entry below ROOT (ROOT itself excluded; top-level names in SKIP
 * left out with everything under them), never following a symlink, each record three
 * NUL-terminated fields:
 *
 *   "T MODE DEV INO SIZE MTIME_NS CTIME_NS RDEV_MAJOR:RDEV_MINOR OPAQUE" NUL PATH NUL TARGET NUL
 *
 * T is f (file), d (directory), l (symlink), c, b, p, s or ? (other); MODE the permission
 * bits in octal; OPAQUE is 1 for a directory whose trusted.overlay.opaque or
 * user.overlay.opaque xattr is "y", else 0; PATH is relative to ROOT; TARGET is a symlink's
 * target (empty otherwise). tenon.host.treewalk writes the same records in Python when this
 * helper is not built. Exit status 1 with a message on stderr on any error.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

static char **skip_names;
static int num_skip;

static void die(const char *what, const char *path) {
    fprintf(stderr, "tenon-treewalk: %s %s: %s\n", what, path, strerror(errno));
    exit(1);
}

static char kind_of(mode_t mode) {
    if (S_ISREG(mode)) return 'f';
    if (S_ISDIR(mode)) return 'd';
    if (S_ISLNK(mode)) return 'l';
    if (S_ISCHR(mode)) return 'c';
    if (S_ISBLK(mode)) return 'b';
    if (S_ISFIFO(mode)) return 'p';
    if (S_ISSOCK(mode)) return 's';
    return '?';
}

static int is_opaque(int fd) {
    static const char *names[] = {"trusted.overlay.opaque", "user.overlay.opaque"};
    char value[4];
    for (int i = 0; i < 2; i++) {
        ssize_t n = fgetxattr(fd, names[i], value, sizeof value);
        if (n == 1 && value[0] == 'y') return 1;
    }
    return 0;
}

static int skipped(const char *name) {
    for (int i = 0; i < num_skip; i++)
        if (strcmp(name, skip_names[i]) == 0) return 1;
    return 0;
}

static void walk(int dirfd, char *path, size_t len, int top) {
    DIR *dir = fdopendir(dirfd);
    if (dir == NULL) die("cannot list", len ? path : ".");
    struct dirent *ent;
    for (errno = 0; (ent = readdir(dir)) != NULL; errno = 0) {
        const char *name = ent->d_name;
        if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) continue;
        if (top && skipped(name)) continue;
        size_t name_len = strlen(name);
        if (len + name_len + 2 > PATH_MAX) {
            errno = ENAMETOOLONG;
            die("path too long under", len ? path : ".");
        }
        size_t sub_len = len ? len + 1 + name_len : name_len;
        if (len) path[len] = '/';
        memcpy(path + (len ? len + 1 : 0), name, name_len + 1);
        struct stat st;
        if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) die("cannot stat", path);
        char target[PATH_MAX + 1];
        target[0] = 0;
        int opaque = 0, child = -1;
        if (S_ISLNK(st.st_mode)) {
            ssize_t n = readlinkat(dirfd, name, target, PATH_MAX);
            if (n < 0) die("cannot read link", path);
            target[n] = 0;
        } else if (S_ISDIR(st.st_mode)) {
            child = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (child < 0) die("cannot open", path);
            opaque = is_opaque(child);
        }
        printf("%c %o %llu %llu %lld %lld %lld %u:%u %d%c%s%c%s%c", kind_of(st.st_mode),
               (unsigned)(st.st_mode & 07777), (unsigned long long)st.st_dev,
               (unsigned long long)st.st_ino, (long long)st.st_size,
               (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
               (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec,
               major(st.st_rdev), minor(st.st_rdev), opaque, 0, path, 0, target, 0);
        if (child >= 0) walk(child, path, sub_len, 0);
        path[len] = 0;
    }
    if (errno != 0) die("cannot read directory", len ? path : ".");
    closedir(dir);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: tenon-treewalk ROOT [SKIP...]\n");
        return 2;
    }
    skip_names = argv + 2;
    num_skip = argc - 2;
    static char out_buf[1 << 20];
    setvbuf(stdout, out_buf, _IOFBF, sizeof out_buf);
    int root = open(argv[1], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (root < 0) die("cannot open", argv[1]);
    static char path[PATH_MAX + 1];
    path[0] = 0;
    walk(root, path, 0, 1);
    if (fflush(stdout) != 0) die("cannot write", "stdout");
    return 0;
}
