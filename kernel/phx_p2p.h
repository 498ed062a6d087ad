/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The vendor contract, kernel side: what vendors/<name>/p2p.c implements.
 *
 * A vendor backend is a small module that fills one struct phx_p2p_ops and
 * registers it with the core module (kernel/phx_core.c) at load time; several
 * backends may be loaded at once and userspace chooses one per device. The core
 * turns the bus addresses a backend returns into ZONE_DEVICE struct pages and maps
 * them into the caller, so O_DIRECT pread/pwrite on that user address goes through
 * the ordinary file system, block layer and NVMe driver into device memory.
 *
 * Page size: a backend pins in units of page_size (64 KiB on NVIDIA and MetaX).
 * It must equal the userspace side's VendorRuntime.p2p_page_size.
 */
#ifndef PHX_P2P_H
#define PHX_P2P_H

#include <linux/types.h>

#define PHX_P2P_ABI_VERSION 1

struct pci_dev;
struct module;

/* Opaque per-pin state of a backend (NVIDIA: nvidia_p2p_page_table_t; MetaX: the
 * acquire_mem handle plus its sg_table). The core only passes it back. */
struct phx_p2p_page_table;

/*
 * Reclaim callback: the vendor driver is taking the memory back (the process freed
 * it, or the device is going away). Called by the backend, possibly in atomic
 * context, at most once per table; it does not sleep: the core queues the work,
 * which revokes the user mappings (later touches get SIGBUS, I/O gets EFAULT), waits
 * (at most 5 s) until no I/O holds the pages, and then calls free_page_table(), never
 * put_pages(), for that table. A vendor whose callback must block until DMA into the
 * memory has stopped (MetaX; NVIDIA's nvidia-fs does the same) waits in its callback
 * for free_page_table(). A reclaim that arrives once put_pages() has begun for the
 * table is ignored, and the backend never calls reclaim for a table after
 * put_pages() returned for it (data may be gone): it makes the two exclusive.
 */
typedef void (*phx_p2p_reclaim_fn)(void *data);

struct phx_p2p_ops {
	u32 abi_version;		/* PHX_P2P_ABI_VERSION */
	const char *name;		/* vendor name, equal to vendors/<name>/ */
	struct module *owner;		/* THIS_MODULE: pinned while a table is live */
	u32 pci_vendor;			/* PCI vendor id the backend serves (0x10de, 0x9999, ...) */
	unsigned long page_size;	/* bytes per P2P page: a power of two */

	/*
	 * Set-up and tear-down of the backend (resolve the vendor's symbols, ...), called
	 * by phx_p2p_register() and phx_p2p_unregister(). init returns 0, or a negative
	 * errno and sets *why to a static sentence saying why it cannot serve here ("the
	 * NVIDIA driver is not loaded (nvidia_p2p_get_pages not found)"); the backend then
	 * stays registered as unavailable, listed with that reason, and exit is not called.
	 * Both may be NULL.
	 */
	int (*init)(const char **why);
	void (*exit)(void);

	/*
	 * Pin [vaddr, vaddr + length) of the calling process's device virtual memory.
	 * vaddr and length are page_size aligned and length > 0 (the core checked).
	 * On success *table is set and reclaim(data) will be called if the vendor takes
	 * the memory back before put_pages(). Returns 0 or a negative errno (-EINVAL
	 * for memory the caller does not own, -ENOMEM, -ENODEV, ...).
	 */
	int (*get_pages)(u64 vaddr, u64 length, struct phx_p2p_page_table **table,
			 phx_p2p_reclaim_fn reclaim, void *data);

	/* Unpin a table from get_pages() (not after a reclaim). Returns 0 or -errno. */
	int (*put_pages)(u64 vaddr, struct phx_p2p_page_table *table);

	/* Number of P2P pages in a table. Callable right after get_pages(). */
	unsigned long (*get_n_pages)(struct phx_p2p_page_table *table);

	/*
	 * Fill addrs[0..n) with the bus address of each page, for DMA by a peer device
	 * (inside the device's largest BAR). Both orders get_pages -> get_phys_addrs and
	 * get_pages -> get_n_pages -> get_phys_addrs must work. Returns 0 or -errno
	 * (-EINVAL if n is not the table's page count).
	 */
	int (*get_phys_addrs)(struct phx_p2p_page_table *table, u64 *addrs, unsigned long n);

	/* Free the heap state of a table after a reclaim; must not call put_pages. */
	void (*free_page_table)(struct phx_p2p_page_table *table);

	/*
	 * The PCI device behind device ordinal 0, 1, ... (NULL past the last one), asked
	 * once after a successful init. The core creates /dev/phx_<name><ordinal> for each
	 * and makes the device's largest memory BAR ZONE_DEVICE pages; every bus address
	 * get_phys_addrs() returns for that device must lie inside that BAR (checked).
	 * The device must stay bound until phx_p2p_unregister() returns.
	 */
	struct pci_dev *(*pci_device)(int ordinal);
};

/*
 * Exported by the core module. register returns 0 also when init() said the backend
 * cannot serve (it is then listed as unavailable); a negative errno only for a bad
 * table (ABI version, page size, name) or a second backend of the same name.
 * unregister revokes every mapping still made through the backend's devices, waits
 * for I/O pinning their pages, and removes the devices; call it from module exit.
 */
int phx_p2p_register(const struct phx_p2p_ops *ops);
void phx_p2p_unregister(const struct phx_p2p_ops *ops);

#endif /* PHX_P2P_H */
