// SPDX-License-Identifier: GPL-2.0
/*
 * phx_ktest: the kernel side's end-to-end test, run inside the QEMU guest (statically
 * linked, no library needed there) and once on the host to check the guest's work from
 * outside. Test code.
 *
 * The fake accelerator is QEMU's ivshmem-plain: BAR 2 is 128 MiB of memory shared with a
 * host file. Layout of that device memory (each region 16 MiB; "pattern" is the same
 * position-dependent bytes everywhere, pattern(i) for byte i of the 16 MiB test file):
 *
 *   A [  0, 16) MiB  the source: filled with the pattern through the BAR (prepare)
 *   B [ 16, 32) MiB  one 16 MiB O_DIRECT read of the ext4 file lands here
 *   C [ 32, 48) MiB  many O_DIRECT reads of odd sizes and 512-byte offsets land here
 *   E [ 48, 64) MiB  an O_DIRECT read of the raw block device lands here
 *   S [ 64,128) MiB  scratch: reclaim, fork, kill -9, vmsplice, bad arguments
 *
 * Commands (the guest's /init runs the first three in this order):
 *   phx_ktest prepare                 fill A through the BAR's sysfs mapping, zero the rest
 *   phx_ktest direct DEV FILE [RAW]   with the modules loaded: map, O_DIRECT (and io_uring),
 *                                     revocation, bad arguments, other processes, kill -9,
 *                                     threads racing reclaims
 *   phx_ktest verify                  modules unloaded: B, C, E equal A through the BAR
 *   phx_ktest hostverify SHM FILE RAW on the host: the BAR's backing file, the file as
 *                                     debugfs dumped it from the ext4 image, the raw image
 * Each prints "PHX-KTEST: <cmd>: N bytes verified, F failures" and exits 0 only when F is 0.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <linux/io_uring.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "phx_ioctl.h"

#define MiB		(1ULL << 20)
#define REGION		(16 * MiB)
#define OFF_A		(0 * MiB)
#define OFF_B		(16 * MiB)
#define OFF_C		(32 * MiB)
#define OFF_E		(48 * MiB)
#define OFF_S		(64 * MiB)
#define BAR_MIN		(128 * MiB)
#define P2P_PAGE	65536ULL
#define SEED		0x7068786b74657374ULL	/* "phxktest" */

static uint64_t verified, failures;
static const char *cmd = "?";

static void say(const char *fmt, ...)
{
	va_list ap;

	printf("PHX-KTEST: ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
}

#define FAIL(...) do { failures++; say("FAIL %s:%d: %s", __FILE__, __LINE__, fmt_(__VA_ARGS__)); } while (0)
#define CHECK(cond, ...) do { if (!(cond)) FAIL(__VA_ARGS__); } while (0)

static const char *fmt_(const char *fmt, ...)
{
	static char buf[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	return buf;
}

static const char *errname(int e)
{
	const char *n = strerrorname_np(e);

	return n ? n : "?";
}

/* ---- the pattern ---------------------------------------------------------------- */

static uint64_t mix(uint64_t x)			/* splitmix64 */
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

/* pattern bytes [off, off + len) into buf; off and len multiples of 8 */
static void pattern(void *buf, uint64_t off, uint64_t len)
{
	uint64_t *w = buf, i;

	for (i = 0; i < len / 8; i++)
		w[i] = mix(SEED ^ (off / 8 + i));
}

/* Compare got[0, len) with pattern [off, off + len); count the bytes when equal. */
static int compare(const char *what, const volatile unsigned char *got, uint64_t off, uint64_t len)
{
	static unsigned char want[1 << 20];
	uint64_t done, n, i;

	for (done = 0; done < len; done += n) {
		n = len - done < sizeof(want) ? len - done : sizeof(want);
		pattern(want, off + done, n);
		for (i = 0; i < n; i++) {
			if (got[done + i] != want[i]) {
				FAIL("%s: byte %llu differs: %#x, expected %#x", what,
				     (unsigned long long)(done + i), got[done + i], want[i]);
				return -1;
			}
		}
	}
	verified += len;
	say("ok   %-52s %llu bytes equal", what, (unsigned long long)len);
	return 0;
}

/* ---- small helpers --------------------------------------------------------------- */

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static long long read_ll(const char *path)
{
	char buf[64] = "";
	int fd = open(path, O_RDONLY);
	ssize_t n;

	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	return n > 0 ? strtoll(buf, NULL, 0) : -1;
}

static int write_str(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY);
	ssize_t n;

	if (fd < 0)
		return -1;
	n = write(fd, s, strlen(s));
	close(fd);
	return n == (ssize_t)strlen(s) ? 0 : -1;
}

/* Wait up to secs for a sysfs counter to read want. */
static int wait_sysfs(const char *path, long long want, double secs)
{
	double end = now() + secs;
	long long v;

	for (;;) {
		v = read_ll(path);
		if (v == want)
			return 0;
		if (now() > end) {
			FAIL("%s is %lld, expected %lld", path, v, want);
			return -1;
		}
		usleep(20000);
	}
}

static int io_all(int write_, int fd, void *buf, uint64_t len, uint64_t off)
{
	uint64_t done = 0;
	ssize_t n;

	while (done < len) {
		n = write_ ? pwrite(fd, (char *)buf + done, len - done, off + done)
			   : pread(fd, (char *)buf + done, len - done, off + done);
		if (n <= 0) {
			if (n == 0)
				errno = EIO;
			return -1;
		}
		done += n;
	}
	return 0;
}

/* The fake accelerator's BAR 2 through sysfs: the device memory's own mapping. */
static unsigned char *bar_map(uint64_t *size, int prot)
{
	static char path[300];
	struct dirent *d;
	struct stat st;
	DIR *dir = opendir("/sys/bus/pci/devices");
	void *p;
	int fd;

	if (!dir)
		return NULL;
	while ((d = readdir(dir))) {
		char v[300];

		if (d->d_name[0] == '.')
			continue;
		snprintf(v, sizeof(v), "/sys/bus/pci/devices/%s/vendor", d->d_name);
		if (read_ll(v) != 0x1af4)
			continue;
		snprintf(v, sizeof(v), "/sys/bus/pci/devices/%s/device", d->d_name);
		if (read_ll(v) != 0x1110)
			continue;
		snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/resource2", d->d_name);
		break;
	}
	closedir(dir);
	if (!d) {
		FAIL("no ivshmem device (1af4:1110) in /sys/bus/pci/devices");
		return NULL;
	}
	fd = open(path, prot & PROT_WRITE ? O_RDWR | O_SYNC : O_RDONLY);
	if (fd < 0 || fstat(fd, &st)) {
		FAIL("open %s: %s", path, strerror(errno));
		return NULL;
	}
	*size = st.st_size;
	p = mmap(NULL, st.st_size, prot, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED) {
		FAIL("mmap %s: %s", path, strerror(errno));
		return NULL;
	}
	say("BAR: %s, %llu MiB", path, (unsigned long long)(st.st_size >> 20));
	return p;
}

/* ---- prepare / verify through the BAR -------------------------------------------- */

static int cmd_prepare(void)
{
	uint64_t size;
	unsigned char *bar = bar_map(&size, PROT_READ | PROT_WRITE);

	if (!bar)
		return 1;
	if (size < BAR_MIN) {
		FAIL("BAR is %llu bytes, the test needs %llu", (unsigned long long)size, BAR_MIN);
		return 1;
	}
	pattern(bar + OFF_A, 0, REGION);
	memset(bar + OFF_B, 0, size - OFF_B);
	compare("prepare: A written through the BAR", bar + OFF_A, 0, REGION);
	munmap(bar, size);
	return 0;
}

static int cmd_verify(void)
{
	uint64_t size;
	unsigned char *bar = bar_map(&size, PROT_READ);

	if (!bar)
		return 1;
	compare("BAR side: A (source) unchanged", bar + OFF_A, 0, REGION);
	compare("BAR side: B (one 16 MiB O_DIRECT read of ext4)", bar + OFF_B, 0, REGION);
	compare("BAR side: C (chunked O_DIRECT reads of ext4)", bar + OFF_C, 0, REGION);
	compare("BAR side: E (O_DIRECT read of the raw disk)", bar + OFF_E, 0, REGION);
	munmap(bar, size);
	return 0;
}

static int cmd_hostverify(const char *shm, const char *dump, const char *raw)
{
	int fd;
	struct stat st;
	unsigned char *p;
	static unsigned char buf[REGION];

	fd = open(shm, O_RDONLY);
	if (fd < 0 || fstat(fd, &st) || st.st_size < (off_t)BAR_MIN) {
		FAIL("%s: cannot read the BAR's backing file", shm);
		return 1;
	}
	p = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED) {
		FAIL("mmap %s: %s", shm, strerror(errno));
		return 1;
	}
	compare("host: BAR backing file, B", p + OFF_B, 0, REGION);
	compare("host: BAR backing file, C", p + OFF_C, 0, REGION);
	compare("host: BAR backing file, E", p + OFF_E, 0, REGION);
	munmap(p, st.st_size);

	fd = open(dump, O_RDONLY);
	if (fd < 0 || io_all(0, fd, buf, REGION, 0))
		FAIL("%s: cannot read 16 MiB (the file dumped from the ext4 image)", dump);
	else
		compare("host: the file in the ext4 image", buf, 0, REGION);
	if (fd >= 0)
		close(fd);
	fd = open(raw, O_RDONLY);
	if (fd < 0 || io_all(0, fd, buf, REGION, 0))
		FAIL("%s: cannot read 16 MiB of the raw disk image", raw);
	else
		compare("host: the raw disk image", buf, 0, REGION);
	if (fd >= 0)
		close(fd);
	return 0;
}

/* ---- the direct path ------------------------------------------------------------- */

static const char *dev_path, *sys_dir;
static uint64_t va_base;
static int dev_fd = -1;

static char *sysf(const char *attr)
{
	static char path[4][300];
	static int k;

	k = (k + 1) % 4;
	snprintf(path[k], sizeof(path[k]), "%s/%s", sys_dir, attr);
	return path[k];
}

static int map(int fd, uint64_t va, uint64_t len, struct phx_map_args *a)
{
	memset(a, 0, sizeof(*a));
	a->dev_va = va;
	a->length = len;
	return ioctl(fd, PHX_IOC_MAP, a);
}

static int unmap(int fd, uint64_t handle)
{
	struct phx_unmap_args u = { .handle = handle };

	return ioctl(fd, PHX_IOC_UNMAP, &u);
}

static unsigned char *map_ok(uint64_t va, uint64_t len, uint64_t *handle, const char *what)
{
	struct phx_map_args a;

	if (map(dev_fd, va, len, &a)) {
		FAIL("MAP %s [%#llx, +%llu): %s", what, (unsigned long long)va,
		     (unsigned long long)len, strerror(errno));
		return NULL;
	}
	*handle = a.handle;
	return (unsigned char *)(uintptr_t)a.addr;
}

static void expect_errno(const char *what, int rc, int want)
{
	int e = errno;

	if (rc == -1 && e == want)
		say("ok   %-52s -> %s", what, errname(want));
	else if (rc == -1)
		FAIL("%s: got %s, expected %s", what, errname(e), errname(want));
	else
		FAIL("%s: succeeded (%d), expected %s", what, rc, errname(want));
}

static int mapped(const void *p)
{
	unsigned char vec;

	return mincore((void *)((uintptr_t)p & ~4095UL), 4096, &vec) == 0;
}

static sigjmp_buf bus_jmp;
static volatile sig_atomic_t got_sigbus;

static void on_sigbus(int sig)
{
	(void)sig;
	got_sigbus = 1;
	siglongjmp(bus_jmp, 1);
}

/* ext4 file and raw disk, through the ZONE_DEVICE mappings of A, B, C, E. */
static void test_transfers(const char *file, const char *raw)
{
	static unsigned char heap[REGION];
	uint64_t ha, hb, hc, he, off, n;
	unsigned char *a, *b, *c, *e;
	static const uint64_t sizes[] = { 512, 4096, 65536 + 512, 1 * MiB, 3 * 4096 + 1536,
					  2 * MiB + 4096, 7 * 512, 128 * 1024 };
	double t;
	int fd, i;

	a = map_ok(va_base + OFF_A, REGION, &ha, "A");
	b = map_ok(va_base + OFF_B, REGION, &hb, "B");
	c = map_ok(va_base + OFF_C, REGION, &hc, "C");
	e = map_ok(va_base + OFF_E, REGION, &he, "E");
	if (!a || !b || !c || !e)
		return;
	CHECK(read_ll(sysf("mappings")) == 4, "sysfs mappings is %lld, expected 4",
	      read_ll(sysf("mappings")));
	CHECK(read_ll(sysf("pinned_bytes")) == (long long)(4 * REGION), "sysfs pinned_bytes wrong");
	{
		long long f0 = read_ll(sysf("faults"));

		compare("CPU through the mapping of A (ZONE_DEVICE pages)", a, 0, REGION);
		/* fault around: one fault maps a 2 MiB block */
		CHECK(read_ll(sysf("faults")) - f0 <= (long long)(REGION >> 21) + 1,
		      "reading 16 MiB took %lld faults (fault-around maps 2 MiB per fault)",
		      read_ll(sysf("faults")) - f0);
	}

	fd = open(file, O_CREAT | O_TRUNC | O_RDWR | O_DIRECT, 0644);
	if (fd < 0) {
		FAIL("open %s O_DIRECT: %s", file, strerror(errno));
		return;
	}
	t = now();
	if (io_all(1, fd, a, REGION, 0))
		FAIL("O_DIRECT pwrite 16 MiB from device memory: %s", strerror(errno));
	else
		say("ok   O_DIRECT pwrite of 16 MiB from device memory (%.2f s)", now() - t);
	CHECK(fsync(fd) == 0, "fsync: %s", strerror(errno));
	t = now();
	if (io_all(0, fd, b, REGION, 0))
		FAIL("O_DIRECT pread 16 MiB into device memory: %s", strerror(errno));
	else
		say("ok   O_DIRECT pread of 16 MiB into device memory (%.2f s)", now() - t);
	for (off = 0, i = 0; off < REGION; off += n, i++) {
		n = sizes[i % (sizeof(sizes) / sizeof(sizes[0]))];
		if (n > REGION - off)
			n = REGION - off;
		if (io_all(0, fd, c + off, n, off)) {
			FAIL("O_DIRECT pread %llu bytes at %llu into C: %s", (unsigned long long)n,
			     (unsigned long long)off, strerror(errno));
			break;
		}
	}
	say("ok   %d O_DIRECT preads of 512 B .. 2 MiB at 512-byte offsets into C", i);
	/* the same file, buffered: what the write from device memory put on disk */
	{
		int bfd = open(file, O_RDONLY);

		if (bfd < 0 || io_all(0, bfd, heap, REGION, 0))
			FAIL("buffered read of %s: %s", file, strerror(errno));
		else
			compare("file on ext4 (buffered read) after the write", heap, 0, REGION);
		if (bfd >= 0)
			close(bfd);
	}
	close(fd);
	compare("CPU through the mapping of B", b, 0, REGION);
	compare("CPU through the mapping of C", c, 0, REGION);

	if (raw) {
		fd = open(raw, O_RDWR | O_DIRECT);
		if (fd < 0) {
			FAIL("open %s O_DIRECT: %s", raw, strerror(errno));
		} else {
			if (io_all(1, fd, a, REGION, 0) || fsync(fd))
				FAIL("O_DIRECT write of the raw disk: %s", strerror(errno));
			else if (io_all(0, fd, e, REGION, 0))
				FAIL("O_DIRECT read of the raw disk: %s", strerror(errno));
			else
				compare("CPU through the mapping of E (raw disk read)", e, 0, REGION);
			close(fd);
		}
	}

	CHECK(unmap(dev_fd, ha) == 0, "UNMAP A: %s", strerror(errno));
	CHECK(unmap(dev_fd, hb) == 0, "UNMAP B: %s", strerror(errno));
	CHECK(unmap(dev_fd, hc) == 0, "UNMAP C: %s", strerror(errno));
	CHECK(unmap(dev_fd, he) == 0, "UNMAP E: %s", strerror(errno));
	CHECK(!mapped(a) && !mapped(e), "the user mapping is still there after UNMAP");
	wait_sysfs(sysf("mappings"), 0, 5);
	wait_sysfs(sysf("pinned_bytes"), 0, 5);
	say("ok   UNMAP: user mappings gone, nothing pinned");
}

/* ---- io_uring (the I/O stack's engine), raw syscalls: no liburing in the guest ---- */

struct ring {
	int fd;
	unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;
	struct io_uring_cqe *cqes;
};

static int ring_init(struct ring *r)
{
	struct io_uring_params p;
	unsigned char *sq, *cq;

	memset(&p, 0, sizeof(p));
	r->fd = syscall(__NR_io_uring_setup, 8, &p);
	if (r->fd < 0)
		return -1;
	sq = mmap(NULL, p.sq_off.array + p.sq_entries * sizeof(unsigned), PROT_READ | PROT_WRITE,
		  MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
	cq = mmap(NULL, p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe), PROT_READ | PROT_WRITE,
		  MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
	r->sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
	if (sq == MAP_FAILED || cq == MAP_FAILED || r->sqes == MAP_FAILED)
		return -1;
	r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
	r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
	r->sq_array = (unsigned *)(sq + p.sq_off.array);
	r->cq_head = (unsigned *)(cq + p.cq_off.head);
	r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
	r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
	r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
	return 0;
}

/* One read, submitted and reaped: returns the CQE's result (bytes or -errno). */
static int ring_read(struct ring *r, int op, int fd, void *buf, unsigned len, uint64_t off)
{
	unsigned tail = *r->sq_tail, idx = tail & *r->sq_mask, head;
	struct io_uring_sqe *sqe = &r->sqes[idx];
	int res;

	memset(sqe, 0, sizeof(*sqe));
	sqe->opcode = op;
	sqe->fd = fd;
	sqe->addr = (uintptr_t)buf;
	sqe->len = len;
	sqe->off = off;
	sqe->buf_index = 0;
	r->sq_array[idx] = idx;
	__atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
	if (syscall(__NR_io_uring_enter, r->fd, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
		return -errno;
	head = *r->cq_head;
	if (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
		return -EAGAIN;
	res = r->cqes[head & *r->cq_mask].res;
	__atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
	return res;
}

static void test_io_uring(const char *file)
{
	uint64_t h, len = 2 * MiB;
	unsigned char *p = map_ok(va_base + OFF_S, len, &h, "S for io_uring");
	struct iovec iov;
	struct ring r;
	int ffd, res;

	if (!p)
		return;
	ffd = open(file, O_RDONLY | O_DIRECT);
	if (ffd < 0 || ring_init(&r)) {
		FAIL("io_uring set-up: %s", strerror(errno));
		return;
	}
	memset(p, 0, len);
	res = ring_read(&r, IORING_OP_READ, ffd, p, len, 4 * MiB);
	CHECK(res == (int)len, "io_uring READ into device memory: %d", res);
	if (res == (int)len)
		compare("io_uring READ (O_DIRECT) into device memory", p, 4 * MiB, len);

	/* registered buffers pin for the long term: the kernel may or may not take them */
	iov.iov_base = p;
	iov.iov_len = len;
	if (syscall(__NR_io_uring_register, r.fd, IORING_REGISTER_BUFFERS, &iov, 1) == 0) {
		memset(p, 0, len);
		res = ring_read(&r, IORING_OP_READ_FIXED, ffd, p, len, 8 * MiB);
		CHECK(res == (int)len, "io_uring READ_FIXED into device memory: %d", res);
		if (res == (int)len)
			compare("io_uring READ_FIXED into registered device memory", p, 8 * MiB, len);
		/* UNMAP while the ring still pins the pages: parked until it lets go */
		CHECK(unmap(dev_fd, h) == 0, "UNMAP with a registered ring: %s", strerror(errno));
		usleep(400000);
		CHECK(read_ll(sysf("pinned_bytes")) == (long long)len,
		      "pages pinned by io_uring were unpinned under it");
		syscall(__NR_io_uring_register, r.fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
		wait_sysfs(sysf("pinned_bytes"), 0, 10);
		say("ok   io_uring fixed buffers: accepted; UNMAP parks until the ring unregisters");
	} else {
		say("ok   io_uring fixed buffers: refused (%s): use plain READ/WRITE", errname(errno));
		CHECK(unmap(dev_fd, h) == 0, "UNMAP: %s", strerror(errno));
	}
	close(r.fd);
	close(ffd);
	wait_sysfs(sysf("mappings"), 0, 5);
}

/* The vendor takes memory back: the mapping is revoked at once. */
static void test_reclaim(const char *file)
{
	uint64_t h, len = 1 * MiB;
	long long before = read_ll(sysf("reclaims"));
	unsigned char *p = map_ok(va_base + OFF_S, len, &h, "S for reclaim");
	struct sigaction sa = { .sa_handler = on_sigbus }, old;
	char va[32];
	int fd;

	if (!p)
		return;
	p[0] = 0x5a;				/* faulted in and writable */
	CHECK(p[0] == 0x5a, "write through the mapping did not stick");
	snprintf(va, sizeof(va), "%#llx", (unsigned long long)(va_base + OFF_S + 4096));
	if (write_str("/sys/module/phx_host/parameters/reclaim", va)) {
		FAIL("cannot trigger a reclaim: %s", strerror(errno));
		return;
	}
	wait_sysfs(sysf("reclaims"), before + 1, 5);
	wait_sysfs(sysf("pinned_bytes"), 0, 5);
	sigaction(SIGBUS, &sa, &old);
	got_sigbus = 0;
	if (!sigsetjmp(bus_jmp, 1))
		(void)*(volatile unsigned char *)(p + 8192);
	sigaction(SIGBUS, &old, NULL);
	CHECK(got_sigbus, "touching a revoked mapping did not raise SIGBUS");
	if (got_sigbus)
		say("ok   touching a revoked mapping -> SIGBUS");
	fd = open(file, O_RDONLY | O_DIRECT);
	expect_errno("O_DIRECT pread into a revoked mapping", fd < 0 ? 0 : (int)pread(fd, p, 65536, 0),
		     EFAULT);
	if (fd >= 0)
		close(fd);
	CHECK(unmap(dev_fd, h) == 0, "UNMAP of a revoked mapping: %s", strerror(errno));
	wait_sysfs(sysf("mappings"), 0, 5);
	say("ok   reclaim: revoked, unpinned, UNMAP still fine");
}

/* Every bad argument gets an error, never an oops (the guest log is checked after). */
static void test_bad_args(void)
{
	struct phx_map_args a;
	struct phx_unmap_args u;
	uint64_t h, h2, bar = read_ll(sysf("bar_size"));
	unsigned char *p;

	expect_errno("MAP length 0", map(dev_fd, va_base, 0, &a), EINVAL);
	expect_errno("MAP unaligned device address (+4 KiB)", map(dev_fd, va_base + 4096, P2P_PAGE, &a), EINVAL);
	expect_errno("MAP unaligned device address (+1)", map(dev_fd, va_base + 1, P2P_PAGE, &a), EINVAL);
	expect_errno("MAP unaligned length (64 KiB + 4 KiB)", map(dev_fd, va_base, P2P_PAGE + 4096, &a), EINVAL);
	expect_errno("MAP overflowing range (end past 2^64)",
		     map(dev_fd, 0xffffffffffff0000ULL, 2 * P2P_PAGE, &a), EOVERFLOW);
	expect_errno("MAP length larger than the device", map(dev_fd, va_base, bar + P2P_PAGE, &a), EINVAL);
	expect_errno("MAP length 2^63", map(dev_fd, va_base, 1ULL << 63, &a), EINVAL);
	expect_errno("MAP not device memory (address 0)", map(dev_fd, 0, P2P_PAGE, &a), EINVAL);
	expect_errno("MAP not device memory (below the device)", map(dev_fd, va_base - P2P_PAGE, P2P_PAGE, &a), EINVAL);
	expect_errno("MAP not device memory (another device's range)", map(dev_fd, 5 * va_base, P2P_PAGE, &a), EINVAL);
	expect_errno("MAP running past the device's memory",
		     map(dev_fd, va_base + bar - P2P_PAGE, 2 * P2P_PAGE, &a), EINVAL);
	memset(&a, 0, sizeof(a));
	a.dev_va = va_base + OFF_S;
	a.length = P2P_PAGE;
	a.flags = 1;
	expect_errno("MAP flags != 0", ioctl(dev_fd, PHX_IOC_MAP, &a), EINVAL);
	a.flags = 0;
	a.pad = 7;
	expect_errno("MAP pad != 0", ioctl(dev_fd, PHX_IOC_MAP, &a), EINVAL);
	expect_errno("MAP argument pointer invalid", ioctl(dev_fd, PHX_IOC_MAP, (void *)8), EFAULT);
	expect_errno("unknown ioctl", ioctl(dev_fd, _IO(PHX_IOC_MAGIC, 99), 0), ENOTTY);

	p = map_ok(va_base + OFF_S, 4 * P2P_PAGE, &h, "S for overlap");
	if (!p)
		return;
	expect_errno("MAP overlapping a mapping of this file",
		     map(dev_fd, va_base + OFF_S + P2P_PAGE, 4 * P2P_PAGE, &a), EEXIST);
	expect_errno("MAP the same range twice", map(dev_fd, va_base + OFF_S, 4 * P2P_PAGE, &a), EEXIST);
	if (!map_ok(va_base + OFF_S + 4 * P2P_PAGE, P2P_PAGE, &h2, "S adjacent"))
		return;
	say("ok   MAP of the adjacent range succeeds");
	expect_errno("mmap of a mapping's offset by hand",
		     mmap(NULL, 4 * P2P_PAGE, PROT_READ, MAP_SHARED, dev_fd, h) == MAP_FAILED ? -1 : 0,
		     EINVAL);
	expect_errno("munmap of part of a mapping", munmap(p + P2P_PAGE, P2P_PAGE), EINVAL);
	expect_errno("mprotect PROT_EXEC", mprotect(p, P2P_PAGE, PROT_READ | PROT_EXEC), EACCES);
	expect_errno("mremap of a mapping",
		     mremap(p, 4 * P2P_PAGE, 8 * P2P_PAGE, MREMAP_MAYMOVE) == MAP_FAILED ? -1 : 0,
		     EFAULT);
	expect_errno("UNMAP handle 0", unmap(dev_fd, 0), EINVAL);
	expect_errno("UNMAP handle with low bits set", unmap(dev_fd, h + 4096), EINVAL);
	expect_errno("UNMAP handle never issued", unmap(dev_fd, h + (1ULL << 40) * 977), EINVAL);
	expect_errno("UNMAP handle ~0", unmap(dev_fd, ~0ULL), EINVAL);
	memset(&u, 0, sizeof(u));
	u.handle = h;
	u.flags = 2;
	expect_errno("UNMAP flags != 0", ioctl(dev_fd, PHX_IOC_UNMAP, &u), EINVAL);
	expect_errno("UNMAP argument pointer invalid", ioctl(dev_fd, PHX_IOC_UNMAP, (void *)8), EFAULT);
	CHECK(unmap(dev_fd, h) == 0, "UNMAP: %s", strerror(errno));
	expect_errno("UNMAP twice", unmap(dev_fd, h), EINVAL);
	CHECK(unmap(dev_fd, h2) == 0, "UNMAP: %s", strerror(errno));
	wait_sysfs(sysf("mappings"), 0, 5);
}

/* Another process cannot use a mapping, a handle or the file of this one. */
static void test_other_process(const char *file)
{
	uint64_t h, len = 1 * MiB;
	unsigned char *p = map_ok(va_base + OFF_S, len, &h, "S for fork");
	int status;
	pid_t pid;

	if (!p)
		return;
	pattern(p, 0, len);
	pid = fork();
	if (pid == 0) {
		struct phx_map_args a;
		struct phx_info_args info;
		int fd2, ffd;

		failures = 0;
		expect_errno("child: UNMAP the parent's mapping (inherited fd)", unmap(dev_fd, h), EPERM);
		expect_errno("child: MAP on the parent's fd", map(dev_fd, va_base + OFF_S + len, P2P_PAGE, &a),
			     EPERM);
		expect_errno("child: INFO on the parent's fd", ioctl(dev_fd, PHX_IOC_INFO, &info), EPERM);
		CHECK(!mapped(p), "child: the parent's mapping was inherited across fork");
		if (!mapped(p))
			say("ok   child: the parent's mapping is not in the child");
		ffd = open(file, O_RDONLY | O_DIRECT);
		expect_errno("child: O_DIRECT pread into the parent's address",
			     ffd < 0 ? 0 : (int)pread(ffd, p, 65536, 0), EFAULT);
		fd2 = open(dev_path, O_RDWR);
		CHECK(fd2 >= 0, "child: open %s: %s", dev_path, strerror(errno));
		expect_errno("child: UNMAP the parent's handle on its own fd", unmap(fd2, h), EINVAL);
		expect_errno("child: mmap the parent's handle on its own fd",
			     mmap(NULL, len, PROT_READ, MAP_SHARED, fd2, h) == MAP_FAILED ? -1 : 0, EINVAL);
		_exit(failures ? 1 : 0);
	}
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
	      WEXITSTATUS(status) == 0, "the child's checks failed");
	compare("parent's mapping intact after the child's attempts", p, 0, len);
	CHECK(unmap(dev_fd, h) == 0, "UNMAP: %s", strerror(errno));
	wait_sysfs(sysf("mappings"), 0, 5);
}

/* kill -9 a process holding mappings: everything is released, even with I/O running. */
static void test_kill9(const char *scratch)
{
	int pfd[2], sp[2], status, i;
	char c;
	pid_t pid;
	static unsigned char got[65536];

	/* 1. a process in a loop of O_DIRECT writes and reads through its mapping */
	if (pipe(pfd))
		return;
	pid = fork();
	if (pid == 0) {
		struct phx_map_args a;
		int fd = open(dev_path, O_RDWR), ffd = open(scratch, O_CREAT | O_RDWR | O_DIRECT, 0644);
		unsigned char *p;

		if (fd < 0 || ffd < 0 || map(fd, va_base + OFF_S, 8 * MiB, &a))
			_exit(2);
		p = (unsigned char *)(uintptr_t)a.addr;
		for (i = 0;; i++) {
			if (io_all(1, ffd, p, 8 * MiB, 0) || io_all(0, ffd, p, 8 * MiB, 0))
				_exit(3);
			if (i == 0 && write(pfd[1], "r", 1) != 1)
				_exit(4);
		}
	}
	close(pfd[1]);
	CHECK(read(pfd[0], &c, 1) == 1, "kill -9 child 1 did not start its I/O loop");
	close(pfd[0]);
	usleep(300000);
	kill(pid, SIGKILL);
	CHECK(waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
	      "kill -9 child 1 did not die of SIGKILL");
	wait_sysfs(sysf("mappings"), 0, 10);
	wait_sysfs(sysf("pinned_bytes"), 0, 10);
	say("ok   kill -9 during O_DIRECT I/O: mappings released");

	/* 2. a process that closed its fd and keeps only the VMA */
	if (pipe(pfd))
		return;
	pid = fork();
	if (pid == 0) {
		struct phx_map_args a;
		int fd = open(dev_path, O_RDWR);

		if (fd < 0 || map(fd, va_base + OFF_S + 8 * MiB, 1 * MiB, &a))
			_exit(2);
		close(fd);
		memset((void *)(uintptr_t)a.addr, 0xa5, 1 * MiB);
		if (write(pfd[1], "r", 1) != 1)
			_exit(4);
		pause();
		_exit(0);
	}
	close(pfd[1]);
	CHECK(read(pfd[0], &c, 1) == 1, "kill -9 child 2 did not map");
	close(pfd[0]);
	CHECK(read_ll(sysf("mappings")) == 1, "child 2's mapping is not counted");
	kill(pid, SIGKILL);
	waitpid(pid, &status, 0);
	wait_sysfs(sysf("mappings"), 0, 10);
	wait_sysfs(sysf("pinned_bytes"), 0, 10);
	say("ok   kill -9 of a process holding only the VMA: released");

	/* 3. pages still referenced after death (vmsplice into a pipe we hold): parked,
	 *    then unpinned once the pipe lets them go */
	if (pipe(pfd) || pipe(sp))
		return;
	pid = fork();
	if (pid == 0) {
		struct phx_map_args a;
		struct iovec iov;
		int fd = open(dev_path, O_RDWR);

		close(sp[0]);
		if (fd < 0 || map(fd, va_base + OFF_S + 16 * MiB, 1 * MiB, &a))
			_exit(2);
		pattern((void *)(uintptr_t)a.addr, 0, 1 * MiB);
		iov.iov_base = (void *)(uintptr_t)a.addr;
		iov.iov_len = sizeof(got);
		if (vmsplice(sp[1], &iov, 1, 0) != (ssize_t)sizeof(got))
			_exit(5);
		if (write(pfd[1], "r", 1) != 1)
			_exit(4);
		pause();
		_exit(0);
	}
	close(pfd[1]);
	close(sp[1]);
	CHECK(read(pfd[0], &c, 1) == 1, "kill -9 child 3 did not vmsplice");
	close(pfd[0]);
	kill(pid, SIGKILL);
	waitpid(pid, &status, 0);
	wait_sysfs(sysf("mappings"), 0, 10);
	usleep(500000);
	CHECK(read_ll(sysf("pinned_bytes")) == (long long)(1 * MiB),
	      "pages referenced by a pipe were unpinned (pinned_bytes %lld)", read_ll(sysf("pinned_bytes")));
	if (read_ll(sysf("pinned_bytes")) == (long long)(1 * MiB))
		say("ok   kill -9 with pages held by a pipe: parked, still pinned");
	for (size_t done = 0; done < sizeof(got);) {
		ssize_t n = read(sp[0], got + done, sizeof(got) - done);

		if (n <= 0) {
			FAIL("read of the pipe: %s", n ? strerror(errno) : "EOF");
			break;
		}
		done += n;
	}
	close(sp[0]);
	compare("pipe contents (vmsplice of device memory)", got, 0, sizeof(got));
	wait_sysfs(sysf("pinned_bytes"), 0, 10);
	say("ok   pipe drained: parked mapping unpinned");
}

/* MAP, O_DIRECT and UNMAP in several threads while the vendor keeps reclaiming. */
#define RACE_THREADS	4
#define RACE_ITERS	60

static const char *race_file;
static volatile int race_stop;
static int race_bad[RACE_THREADS], race_maps[RACE_THREADS], race_eagain[RACE_THREADS],
	   race_efault[RACE_THREADS];

static void *race_worker(void *arg)
{
	long k = (long)arg;
	uint64_t va = va_base + OFF_S + 32 * MiB + (uint64_t)k * 4 * MiB;
	int ffd = open(race_file, O_RDONLY | O_DIRECT), i;

	for (i = 0; i < RACE_ITERS; i++) {
		struct phx_map_args a;
		ssize_t n;

		if (map(dev_fd, va, 2 * MiB, &a)) {
			if (errno == EAGAIN)
				race_eagain[k]++;
			else
				race_bad[k]++;
			continue;
		}
		race_maps[k]++;
		n = pread(ffd, (void *)(uintptr_t)a.addr, 1 * MiB, (i % 8) * MiB);
		if (n < 0 && errno == EFAULT)
			race_efault[k]++;
		else if (n < 0)
			race_bad[k]++;
		if (unmap(dev_fd, a.handle))
			race_bad[k]++;
	}
	close(ffd);
	return NULL;
}

static void test_races(const char *file)
{
	pthread_t th[RACE_THREADS];
	int i, bad = 0, maps = 0, eagain = 0, efault = 0, reclaims = 0;
	long long before = read_ll(sysf("reclaims"));

	race_file = file;
	for (i = 0; i < RACE_THREADS; i++)
		pthread_create(&th[i], NULL, race_worker, (void *)(long)i);
	for (i = 0; i < 400 && !race_stop; i++) {
		write_str("/sys/module/phx_host/parameters/reclaim", "all");
		reclaims++;
		usleep(2000);
		if (read_ll(sysf("mappings")) < 0)
			break;
	}
	for (i = 0; i < RACE_THREADS; i++) {
		pthread_join(th[i], NULL);
		bad += race_bad[i];
		maps += race_maps[i];
		eagain += race_eagain[i];
		efault += race_efault[i];
	}
	CHECK(bad == 0, "races: %d unexpected errors", bad);
	wait_sysfs(sysf("mappings"), 0, 10);
	wait_sysfs(sysf("pinned_bytes"), 0, 10);
	say("ok   races: %d MAP/O_DIRECT/UNMAP cycles in %d threads against %d reclaims "
	    "(%lld took effect; %d MAP EAGAIN, %d I/O EFAULT): nothing left pinned",
	    maps, RACE_THREADS, reclaims, read_ll(sysf("reclaims")) - before, eagain, efault);
}

static int cmd_direct(const char *dev, const char *file, const char *raw)
{
	static char sysbuf[300], scratch[300];
	struct phx_info_args info;
	const char *base = strrchr(dev, '/');

	dev_path = dev;
	snprintf(sysbuf, sizeof(sysbuf), "/sys/class/phx/%s", base ? base + 1 : dev);
	sys_dir = sysbuf;
	snprintf(scratch, sizeof(scratch), "%s.scratch", file);
	va_base = read_ll("/sys/module/phx_host/parameters/va_base");
	dev_fd = open(dev, O_RDWR | O_CLOEXEC);
	if (dev_fd < 0) {
		FAIL("open %s: %s", dev, strerror(errno));
		return 1;
	}
	if (ioctl(dev_fd, PHX_IOC_INFO, &info)) {
		FAIL("INFO: %s", strerror(errno));
		return 1;
	}
	say("device %s: vendor %s, ordinal %u, page size %llu, BAR %llu MiB, ABI %u; map_mode %s", dev,
	    info.vendor, info.ordinal, (unsigned long long)info.page_size,
	    (unsigned long long)(info.bar_size >> 20), info.abi,
	    read_ll(sysf("page_size")) == (long long)info.page_size ? "ok" : "?");
	CHECK(info.abi == PHX_IOCTL_ABI && info.page_size == P2P_PAGE && !strcmp(info.vendor, "host") &&
	      info.bar_size >= BAR_MIN && va_base > 0, "INFO / sysfs disagree with the test's assumptions");
	if (failures)
		return 1;
	test_transfers(file, raw);
	test_io_uring(file);
	test_reclaim(file);
	test_bad_args();
	test_other_process(file);
	test_kill9(scratch);
	test_races(file);
	close(dev_fd);
	wait_sysfs(sysf("mappings"), 0, 5);
	return 0;
}

int main(int argc, char **argv)
{
	double t = now();
	int rc = 2;

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 2)
		cmd = argv[1];
	if (argc == 2 && !strcmp(cmd, "prepare"))
		rc = cmd_prepare();
	else if ((argc == 4 || argc == 5) && !strcmp(cmd, "direct"))
		rc = cmd_direct(argv[2], argv[3], argc == 5 ? argv[4] : NULL);
	else if (argc == 2 && !strcmp(cmd, "verify"))
		rc = cmd_verify();
	else if (argc == 5 && !strcmp(cmd, "hostverify"))
		rc = cmd_hostverify(argv[2], argv[3], argv[4]);
	else {
		fprintf(stderr, "usage: phx_ktest prepare | direct DEV FILE [RAW] | verify | "
				"hostverify SHM FILE RAW\n");
		return 2;
	}
	say("%s: %llu bytes verified, %llu failures (%.1f s)", cmd, (unsigned long long)verified,
	    (unsigned long long)failures, now() - t);
	return rc || failures ? 1 : 0;
}
