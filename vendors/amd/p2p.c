// SPDX-License-Identifier: GPL-2.0
/*
 * phx_amd: AMD's kernel side of the vendor contract (kernel/phx_p2p.h).
 *
 * Vendor side, control plane. GPU memory is pinned with AMD's RDMA peer interface, the
 * table of functions that amdkfd (built into amdgpu since 4.20) hands out through
 * amdkfd_query_rdma_interface():
 *   get_pages  = rdma->get_pages: the calling process's HIP virtual address range -> an
 *                sg_table of bus addresses (DMA-mapped for the dma_dev we pass)
 *   put_pages  = rdma->put_pages
 *   reclaim    = the free_callback given to get_pages: "access must stop immediately"
 *                (the memory was freed, a GECC event, ...); once it returns the driver
 *                releases everything behind the amd_p2p_info. We hand it to the core and
 *                wait (bounded) for free_page_table, as the NVIDIA and MetaX backends do.
 * amdkfd_query_rdma_interface is resolved when the module loads (symbol_get), so the
 * module loads on any host, and without the driver stays registered as unavailable and
 * says why. Only ROCm's out-of-tree amdgpu (amdgpu-dkms, ROCK-Kernel-Driver) exports it:
 * the amdgpu of mainline Linux does not. It is a plain EXPORT_SYMBOL, which kernels from
 * 6.6 on refuse to symbol_get (the same limit as nvidia_p2p_*).
 *
 * amd_rdma.h ships with that driver (include/drm/amd_rdma.h), not with Debian: the types
 * are declared below from its documented layout, API 2.0 (AMD_RDMA_MAJOR 2, ROCm 4.2 and
 * later: get_pages takes a dma_dev, amd_p2p_info lost its kfd_proc field). A 1.0 driver
 * (ROCm 4.1 and older) has no dma_dev argument and cannot be told apart from here: it is
 * not supported. We only read va, size and pages, never allocate the structure.
 *
 * What the driver does, and why the code below is shaped by it (ROCK-Kernel-Driver,
 * drivers/gpu/drm/amd/amdkfd/kfd_peerdirect.c and kfd_process.c):
 *   - pid NULL means the current process: MAP runs in the caller's context.
 *   - get_pages finds the buffer object with an interval search that rejects a range
 *     spanning two BOs but not one running past the end of a BO into unallocated VA
 *     (the sg_table would then be built past the BO). So both ends are checked with
 *     is_gpu_address first: two ends in BOs and one BO overlapping = one BO holding all.
 *   - get_pages can return 0 without setting the amd_p2p_info (when no BO matched):
 *     success without a table is treated as -EINVAL.
 *   - The sg_table's DMA addresses come from dma_map_resource(dma_dev, BAR address):
 *     with the IOMMU off or in passthrough, which the direct path needs anyway (the disk
 *     must reach the BAR), they are the BAR's bus addresses whatever device we name; we
 *     name the first AMD GPU. Under a translating IOMMU they are not, and the core's
 *     check that every page lies in the BAR refuses the mapping.
 *   - get_page_size answers PAGE_SIZE (VRAM is handed out in buddy blocks, naturally
 *     aligned, 2 MiB ones for sizes in whole 2 MiB): we split the entries into 64 KiB
 *     pages, the page size of the userspace side, and refuse a range whose entries are
 *     not 64 KiB aligned (a small allocation's 4 KiB blocks) rather than map it wrongly.
 *   - Memory not in VRAM (GTT, host) has no BAR address: the core refuses it.
 *
 * Devices: display controllers and processing accelerators of PCI vendor 0x1002 in PCI
 * order; HIP numbers them in KFD topology order, normally the same.
 *
 * Not tested on hardware here; compile-tested with -Werror (and sparse) and load-tested
 * without the driver in the QEMU test.
 */
#define pr_fmt(fmt) "phx_amd: " fmt

#include <linux/completion.h>
#include <linux/kref.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/spinlock.h>

#include "phx_p2p.h"

/* ---- from amd_rdma.h (documented layout, API 2.0) --------------------------------- */

struct pid;

struct amd_p2p_info {
	u64 va;				/* user virtual address this table describes */
	u64 size;			/* its length */
	struct pid *pid;		/* the process the address belongs to */
	struct sg_table *pages;		/* DMA (bus) addresses */
	void *priv;			/* the driver's */
};

struct amd_rdma_interface {
	int (*get_pages)(u64 address, u64 length, struct pid *pid, struct device *dma_dev,
			 struct amd_p2p_info **amd_p2p_data,
			 void (*free_callback)(void *client_priv), void *client_priv);
	int (*put_pages)(struct amd_p2p_info **amd_p2p_data);
	int (*is_gpu_address)(u64 address, struct pid *pid);
	int (*get_page_size)(u64 address, u64 length, struct pid *pid,
			     unsigned long *page_size);
};

int amdkfd_query_rdma_interface(const struct amd_rdma_interface **rdma);

/* ---- the backend ----------------------------------------------------------------- */

#define AMD_PAGE_SIZE		SZ_64K	/* equal to the userspace side's p2p_page_size */
#define AMD_MAX_DEVS		64
#define AMD_RECLAIM_WAIT_MS	10000

static typeof(&amdkfd_query_rdma_interface) amd_query;
static const struct amd_rdma_interface *amd_rdma;

static struct pci_dev *amd_devs[AMD_MAX_DEVS];
static int amd_ndevs;

/*
 * PINNING: the driver's get_pages is running or we are still reading its sg_table; a
 * free callback then only waits until we are done (the core does not know the table
 * yet) and the pin fails with -EAGAIN. PINNED: the core's. PUTTING / RECLAIMING: one
 * of put_pages and the free callback won, the other leaves the driver's table alone.
 */
enum { AMD_PINNING, AMD_PINNED, AMD_PUTTING, AMD_RECLAIMING };

struct phx_p2p_page_table {
	struct kref ref;		/* the core's (or the pin's), and a running callback's */
	spinlock_t lock;		/* state */
	int state;
	struct amd_p2p_info *info;	/* the driver's: dead once its free callback returned */
	u64 vaddr;
	unsigned long n;
	u64 *bus;			/* copied at pin time: never read the driver's table later */
	phx_p2p_reclaim_fn reclaim;
	void *data;
	struct completion released;	/* the core (or the pin) is done with the memory */
};

static void amd_table_free(struct kref *ref)
{
	struct phx_p2p_page_table *t = container_of(ref, struct phx_p2p_page_table, ref);

	kvfree(t->bus);
	kfree(t);
}

/* The driver takes the memory back; it releases its table once we return. */
static void amd_free_callback(void *client_priv)
{
	struct phx_p2p_page_table *t = client_priv;
	bool notify = false, wait = false;

	spin_lock(&t->lock);
	if (t->state == AMD_PINNED || t->state == AMD_PINNING) {
		notify = t->state == AMD_PINNED;
		wait = true;
		t->state = AMD_RECLAIMING;
	}
	kref_get(&t->ref);
	spin_unlock(&t->lock);
	if (notify)
		t->reclaim(t->data);
	/* the driver calls back from process context when memory is freed; never sleep in
	 * an interrupt */
	if (wait && (!in_task() ||
		     !wait_for_completion_timeout(&t->released, msecs_to_jiffies(AMD_RECLAIM_WAIT_MS))))
		pr_warn("GPU memory at %#llx reclaimed before its I/O finished\n", t->vaddr);
	kref_put(&t->ref, amd_table_free);
}

/* Split the driver's sg_table into 64 KiB bus addresses. */
static int amd_fill_bus(struct phx_p2p_page_table *t)
{
	struct sg_table *sgt = t->info->pages;
	struct scatterlist *sg;
	unsigned long k = 0;
	unsigned int i;

	if (!sgt)
		return -EINVAL;
	for_each_sgtable_dma_sg(sgt, sg, i) {
		u64 addr = sg_dma_address(sg);
		u64 len = sg_dma_len(sg), off;

		if (!IS_ALIGNED(addr, AMD_PAGE_SIZE) || !IS_ALIGNED(len, AMD_PAGE_SIZE))
			return -EINVAL;
		for (off = 0; off < len; off += AMD_PAGE_SIZE) {
			if (k == t->n)
				return -EINVAL;
			t->bus[k++] = addr + off;
		}
	}
	return k == t->n ? 0 : -EINVAL;
}

static int amd_pin(u64 vaddr, u64 length, struct phx_p2p_page_table **table,
		   phx_p2p_reclaim_fn reclaim, void *data)
{
	struct phx_p2p_page_table *t;
	bool reclaimed;
	int err;

	/* the whole range in one buffer object of this process (see the top of the file) */
	if (!amd_rdma->is_gpu_address(vaddr, NULL) ||
	    !amd_rdma->is_gpu_address(vaddr + length - 1, NULL))
		return -EINVAL;

	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return -ENOMEM;
	t->n = length / AMD_PAGE_SIZE;
	t->bus = kvcalloc(t->n, sizeof(*t->bus), GFP_KERNEL);
	if (!t->bus) {
		kfree(t);
		return -ENOMEM;
	}
	kref_init(&t->ref);
	spin_lock_init(&t->lock);
	init_completion(&t->released);
	t->state = AMD_PINNING;
	t->vaddr = vaddr;
	t->reclaim = reclaim;
	t->data = data;

	/* pid NULL: the calling process; the first GPU as dma_dev (see the top of the file) */
	err = amd_rdma->get_pages(vaddr, length, NULL, &amd_devs[0]->dev, &t->info,
				  amd_free_callback, t);
	if (err || !t->info) {
		kref_put(&t->ref, amd_table_free);
		return err ? err : -EINVAL;
	}
	err = amd_fill_bus(t);
	if (err)
		pr_err("sg_table of [%#llx, +%llu) does not hold %lu aligned 64 KiB pages\n", vaddr,
		       length, t->n);

	spin_lock(&t->lock);
	reclaimed = t->state == AMD_RECLAIMING;
	if (!reclaimed)
		t->state = err ? AMD_PUTTING : AMD_PINNED;
	spin_unlock(&t->lock);
	if (reclaimed) {
		/* freed while we pinned: the driver owns its table now; let its callback go */
		complete(&t->released);
		kref_put(&t->ref, amd_table_free);
		return -EAGAIN;
	}
	if (err) {
		amd_rdma->put_pages(&t->info);
		kref_put(&t->ref, amd_table_free);
		return err;
	}
	*table = t;
	return 0;
}

static int amd_unpin(u64 vaddr, struct phx_p2p_page_table *t)
{
	bool ours;
	int err = 0;

	spin_lock(&t->lock);
	ours = t->state == AMD_PINNED;
	if (ours)
		t->state = AMD_PUTTING;
	spin_unlock(&t->lock);
	complete(&t->released);		/* a racing free callback need not wait */
	if (ours)
		err = amd_rdma->put_pages(&t->info);
	kref_put(&t->ref, amd_table_free);
	return err;
}

static unsigned long amd_get_n_pages(struct phx_p2p_page_table *t)
{
	return t->n;
}

static int amd_get_phys_addrs(struct phx_p2p_page_table *t, u64 *addrs, unsigned long n)
{
	if (n != t->n)
		return -EINVAL;
	memcpy(addrs, t->bus, n * sizeof(*addrs));
	return 0;
}

/* After a reclaim, once the core has revoked and the I/O is done: release the callback.
 * The driver frees its table after the callback: no put_pages here. */
static void amd_free_table(struct phx_p2p_page_table *t)
{
	complete(&t->released);
	kref_put(&t->ref, amd_table_free);
}

static struct pci_dev *amd_pci_device(int ordinal)
{
	return ordinal >= 0 && ordinal < amd_ndevs ? amd_devs[ordinal] : NULL;
}

static void amd_put_symbols(void)
{
	if (amd_query)
		symbol_put(amdkfd_query_rdma_interface);
	amd_query = NULL;
	amd_rdma = NULL;
}

static int amd_init(const char **why)
{
	const struct amd_rdma_interface *rdma = NULL;
	struct pci_dev *pdev = NULL;

	amd_query = symbol_get(amdkfd_query_rdma_interface);
	if (!amd_query) {
		*why = "the AMD driver is not loaded (amdkfd_query_rdma_interface not found: ROCm's "
		       "amdgpu-dkms exports it, mainline amdgpu does not; kernels from 6.6 on also "
		       "refuse symbol_get of non-GPL exports)";
		return -ENOENT;
	}
	if (amd_query(&rdma) || !rdma || !rdma->get_pages || !rdma->put_pages ||
	    !rdma->is_gpu_address) {
		amd_put_symbols();
		*why = "the AMD driver's RDMA interface is incomplete (amdkfd_query_rdma_interface)";
		return -ENOSYS;
	}
	amd_rdma = rdma;
	/* GPUs: display controllers and processing accelerators of vendor AMD, in PCI order */
	while ((pdev = pci_get_device(PCI_VENDOR_ID_ATI, PCI_ANY_ID, pdev))) {
		u8 base = pdev->class >> 16;

		if (base != PCI_BASE_CLASS_DISPLAY && base != 0x12)	/* processing accelerator */
			continue;
		if (amd_ndevs == AMD_MAX_DEVS)
			break;
		amd_devs[amd_ndevs++] = pci_dev_get(pdev);
	}
	pci_dev_put(pdev);
	if (!amd_ndevs) {
		amd_put_symbols();
		*why = "the AMD driver is loaded but no AMD GPU (PCI vendor 0x1002) was found";
		return -ENODEV;
	}
	return 0;
}

static void amd_exit(void)
{
	while (amd_ndevs)
		pci_dev_put(amd_devs[--amd_ndevs]);
	amd_put_symbols();
}

static const struct phx_p2p_ops amd_ops = {
	.abi_version = PHX_P2P_ABI_VERSION,
	.name = "amd",
	.owner = THIS_MODULE,
	.pci_vendor = PCI_VENDOR_ID_ATI,
	.page_size = AMD_PAGE_SIZE,
	.init = amd_init,
	.exit = amd_exit,
	.get_pages = amd_pin,
	.put_pages = amd_unpin,
	.get_n_pages = amd_get_n_pages,
	.get_phys_addrs = amd_get_phys_addrs,
	.free_page_table = amd_free_table,
	.pci_device = amd_pci_device,
};

static int __init amd_mod_init(void)
{
	return phx_p2p_register(&amd_ops);
}

static void __exit amd_mod_exit(void)
{
	phx_p2p_unregister(&amd_ops);
}

module_init(amd_mod_init);
module_exit(amd_mod_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Phoenix AMD backend: GPU memory pinned through amdkfd_query_rdma_interface");
