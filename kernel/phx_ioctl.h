/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * The user <-> kernel interface of the core module: /dev/phx_<vendor><N> and its ioctls.
 *
 * Shared by kernel/phx_core.c, the QEMU test program (kernel/qemu/phx_ktest.c) and
 * phoenix/kmod.py (which mirrors the numbers; tests/test_kernel.py checks they agree).
 *
 *   fd = open("/dev/phx_host0", O_RDWR | O_CLOEXEC);
 *   struct phx_map_args m = { .dev_va = va, .length = len };
 *   ioctl(fd, PHX_IOC_MAP, &m);      // m.addr: a user address that maps the device memory
 *   pread(file_fd_opened_O_DIRECT, (void *)m.addr, len, off);   // disk DMAs into device memory
 *   struct phx_unmap_args u = { .handle = m.handle };
 *   ioctl(fd, PHX_IOC_UNMAP, &u);    // unpins, and removes the user mapping
 *
 * Rules: dev_va and length are multiples of the device's page_size (64 KiB on NVIDIA and
 * MetaX), length > 0; flags and pad are zero. Only the process that opened the file may
 * use it (another process, a fork child included, gets EPERM). Mappings of one file do not
 * overlap (EEXIST). Every mapping ends at UNMAP, at close of the last reference to the file,
 * or at process exit (kill -9 included); the vendor may revoke one earlier (its memory was
 * freed): the user mapping then faults (SIGBUS) and I/O into it fails (EFAULT).
 */
#ifndef PHX_IOCTL_H
#define PHX_IOCTL_H

#include <linux/types.h>
#include <linux/ioctl.h>

#define PHX_IOCTL_ABI 1

#define PHX_IOC_MAGIC 0xB7

struct phx_info_args {
	__u32 abi;		/* out: PHX_IOCTL_ABI */
	__u32 ordinal;		/* out: device ordinal within its vendor */
	__u64 page_size;	/* out: P2P page size in bytes */
	__u64 bar_size;		/* out: bytes of device memory the core can map (the BAR) */
	__u64 max_map;		/* out: the largest length one MAP accepts */
	char vendor[16];	/* out: vendor name, NUL terminated */
};

struct phx_map_args {
	__u64 dev_va;		/* in: device virtual address, page_size aligned */
	__u64 length;		/* in: bytes, a non-zero multiple of page_size */
	__u32 flags;		/* in: 0 */
	__u32 pad;		/* in: 0 */
	__u64 handle;		/* out: names the mapping for UNMAP (also its mmap offset) */
	__u64 addr;		/* out: user address of the mapping (PROT_READ|PROT_WRITE, MAP_SHARED) */
};

struct phx_unmap_args {
	__u64 handle;		/* in: from MAP */
	__u32 flags;		/* in: 0 */
	__u32 pad;		/* in: 0 */
};

#define PHX_IOC_INFO	_IOR(PHX_IOC_MAGIC, 0, struct phx_info_args)
#define PHX_IOC_MAP	_IOWR(PHX_IOC_MAGIC, 1, struct phx_map_args)
#define PHX_IOC_UNMAP	_IOW(PHX_IOC_MAGIC, 2, struct phx_unmap_args)

#endif /* PHX_IOCTL_H */
