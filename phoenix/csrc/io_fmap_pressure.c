/* Watching memory pressure for the file-mapping cache: registered windows pin page-cache
 * pages the kernel can then not reclaim, so they are all given back when memory is short.
 *
 * Core side, data path off the request path: called by the registrar thread only (its
 * housekeeping, io_fmap_register.c). Where /proc/pressure/memory exists and takes a trigger
 * (Linux 4.20+ with PSI; unprivileged from 6.5, hence a 2 s window), the signal is the
 * trigger "some 150 ms of stall in 2 s": the kernel latches the event until poll(POLLPRI)
 * reads it. Else (no PSI, or refused) MemAvailable under 5% of MemTotal, read from
 * /proc/meminfo at each housekeeping tick. Both are checked when the trigger exists.
 */
#include "io_ctx.h"
#include "io_fmap.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PSI_PATH "/proc/pressure/memory"
#define PSI_TRIGGER "some 150000 2000000"
#define MEMAVAIL_PERCENT 5

static void set_how(struct io_fmap *m, const char *how)
{
    pthread_mutex_lock(&m->mu);
    snprintf(m->pressure_how, sizeof(m->pressure_how), "%s", how);
    pthread_mutex_unlock(&m->mu);
}

static void psi_open(struct io_fmap *m)
{
    char how[96];
    int fd = open(PSI_PATH, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0 && write(fd, PSI_TRIGGER, sizeof(PSI_TRIGGER)) < 0) {
        int e = errno;
        close(fd);
        fd = -1;
        errno = e;
    }
    if (fd >= 0)
        snprintf(how, sizeof(how), "PSI trigger (%s: some 150 ms in 2 s) and MemAvailable < %d%%", PSI_PATH,
                 MEMAVAIL_PERCENT);
    else
        snprintf(how, sizeof(how), "MemAvailable < %d%% of MemTotal (PSI: %s)", MEMAVAIL_PERCENT, strerror(errno));
    m->psi_fd = fd;
    set_how(m, how);
}

/* MemAvailable under MEMAVAIL_PERCENT of MemTotal? (0 when /proc/meminfo cannot be read) */
static int meminfo_low(void)
{
    char buf[4096];
    int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    const char *t = strstr(buf, "MemTotal:"), *a = strstr(buf, "MemAvailable:");
    if (!t || !a)
        return 0;
    unsigned long long total = strtoull(t + 9, NULL, 10), avail = strtoull(a + 13, NULL, 10);
    return total > 0 && avail * 100 < total * MEMAVAIL_PERCENT;
}

int fmap_pressure_check(struct io_fmap *m)
{
    if (!m->psi_tried) {
        m->psi_tried = 1;
        psi_open(m);
    }
    if (m->psi_fd >= 0) {
        struct pollfd p = {.fd = m->psi_fd, .events = POLLPRI};
        int r = poll(&p, 1, 0);
        if (r > 0 && (p.revents & POLLPRI))
            return 1;
        if (r > 0 && (p.revents & (POLLERR | POLLNVAL))) { /* the trigger is gone: MemAvailable only */
            close(m->psi_fd);
            m->psi_fd = -1;
            set_how(m, "MemAvailable < 5% of MemTotal (the PSI trigger failed)");
        }
    }
    return meminfo_low();
}

void fmap_pressure_close(struct io_fmap *m)
{
    if (m->psi_fd >= 0)
        close(m->psi_fd);
    m->psi_fd = -1;
}
