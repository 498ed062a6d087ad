// SPDX-License-Identifier: GPL-2.0
/*
 * phx_nvidia: NVIDIA's kernel side of the vendor contract (kernel/phx_p2p.h).
 *
 * Vendor side, control plane. GPU memory is pinned with the NVIDIA driver's P2P API
 * (nvidia_p2p_get_pages: the calling process's CUDA virtual address range, 64 KiB GPU
 * pages); each page's physical_address lies in the GPU's BAR1, which the core makes
 * ZONE_DEVICE pages. The nvidia_p2p_* functions are resolved when the module loads
 * (symbol_get), so it loads on any host, and where the NVIDIA driver is absent it stays
 * registered as unavailable, saying why (/sys/class/phx/backends, phx info).
 *
 * nv-p2p.h ships with NVIDIA's kernel module sources, which Debian's main archive lacks:
 * the few types used are declared below from its documented x86-64 layout (open-gpu-
 * kernel-modules, kernel-open/nvidia/nv-p2p.h; page table version 1.x). Fields after
 * those used may exist; the driver allocates the tables, we only read them.
 *
 * Reclaim: when the process frees the memory (or the driver needs it back) the driver
 * calls our free callback. We hand it to the core, wait (bounded) until the core has
 * revoked the mappings and in-flight I/O is done (free_page_table), and then free the
 * driver's table with nvidia_p2p_free_page_table from inside the callback, as the
 * driver's documentation asks.
 *
 * Not tested on hardware here (there is no module tree on the GPU machine); compile-tested
 * with -Werror and load-tested without the driver in the QEMU test.
 */
#define pr_fmt(fmt) "phx_nvidia: " fmt

#include <linux/completion.h>
#include <linux/kref.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/spinlock.h>

#include "phx_p2p.h"

/* ---- from nv-p2p.h (documented layout) -------------------------------------------- */

#define NVIDIA_P2P_PAGE_TABLE_VERSION_MAJOR	0x0001
enum nvidia_p2p_page_size_type {
	NVIDIA_P2P_PAGE_SIZE_4KB = 0,
	NVIDIA_P2P_PAGE_SIZE_64KB,
	NVIDIA_P2P_PAGE_SIZE_128KB,
};

struct nvidia_p2p_page {
	u64 physical_address;
	/* request registers follow (Fermi-era); unused */
};

struct nvidia_p2p_page_table {
	u32 version;
	u32 page_size;			/* enum nvidia_p2p_page_size_type */
	struct nvidia_p2p_page **pages;
	u32 entries;
	u8 *gpu_uuid;
	/* flags follow in newer drivers; unused */
};

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address, u64 length,
			 struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data);
int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table);
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table);

/* ---- the backend ----------------------------------------------------------------- */

#define NV_PAGE_SIZE		SZ_64K
#define NV_MAX_DEVS		64
#define NV_RECLAIM_WAIT_MS	10000

static typeof(&nvidia_p2p_get_pages) nv_get_pages;
static typeof(&nvidia_p2p_put_pages) nv_put_pages;
static typeof(&nvidia_p2p_free_page_table) nv_free_page_table;

static struct pci_dev *nv_devs[NV_MAX_DEVS];
static int nv_ndevs;

enum { NV_PINNED, NV_PUTTING, NV_RECLAIMING };

struct phx_p2p_page_table {
	struct kref ref;		/* the core's, and a running free callback's */
	spinlock_t lock;		/* state */
	int state;
	struct nvidia_p2p_page_table *nv;
	u64 vaddr;
	unsigned long n;
	u64 *bus;			/* copied at pin time: never read the driver's table later */
	phx_p2p_reclaim_fn reclaim;
	void *data;
	struct completion released;	/* the core is done with the memory */
};

static void nv_table_free(struct kref *ref)
{
	struct phx_p2p_page_table *t = container_of(ref, struct phx_p2p_page_table, ref);

	kvfree(t->bus);
	kfree(t);
}

/* The driver takes the memory back. May run in any context the driver chooses. */
static void nv_free_callback(void *data)
{
	struct phx_p2p_page_table *t = data;
	bool ours;

	spin_lock(&t->lock);
	ours = t->state == NV_PINNED;
	if (ours)
		t->state = NV_RECLAIMING;
	kref_get(&t->ref);
	spin_unlock(&t->lock);
	if (ours) {
		t->reclaim(t->data);
		/* cudaFree calls back in process context; never sleep in an interrupt */
		if (!in_task() ||
		    !wait_for_completion_timeout(&t->released, msecs_to_jiffies(NV_RECLAIM_WAIT_MS)))
			pr_warn("GPU memory at %#llx reclaimed before its I/O finished\n", t->vaddr);
	}
	/* The driver wants its table freed during the callback, put_pages or not. */
	nv_free_page_table(t->nv);
	kref_put(&t->ref, nv_table_free);
}

static int nv_pin(u64 vaddr, u64 length, struct phx_p2p_page_table **table,
		  phx_p2p_reclaim_fn reclaim, void *data)
{
	struct phx_p2p_page_table *t;
	struct nvidia_p2p_page_table *nv;
	unsigned long i;
	int err;

	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return -ENOMEM;
	t->n = length / NV_PAGE_SIZE;
	t->bus = kvcalloc(t->n, sizeof(*t->bus), GFP_KERNEL);
	if (!t->bus) {
		kfree(t);
		return -ENOMEM;
	}
	kref_init(&t->ref);
	spin_lock_init(&t->lock);
	init_completion(&t->released);
	t->state = NV_PINNED;
	t->vaddr = vaddr;
	t->reclaim = reclaim;
	t->data = data;

	/* token 0, va_space 0: the calling process's CUDA address space */
	err = nv_get_pages(0, 0, vaddr, length, &nv, nv_free_callback, t);
	if (err) {
		kref_put(&t->ref, nv_table_free);
		return err;
	}
	t->nv = nv;
	err = -EINVAL;
	if ((nv->version >> 16) != NVIDIA_P2P_PAGE_TABLE_VERSION_MAJOR) {
		pr_err("unsupported P2P page table version %#x\n", nv->version);
		goto put;
	}
	if (nv->page_size != NVIDIA_P2P_PAGE_SIZE_64KB || nv->entries != t->n) {
		pr_err("unexpected P2P page table: page size type %u, %u entries for %llu bytes\n",
		       nv->page_size, nv->entries, length);
		goto put;
	}
	for (i = 0; i < t->n; i++)
		t->bus[i] = nv->pages[i]->physical_address;
	*table = t;
	return 0;
put:
	spin_lock(&t->lock);
	t->state = NV_PUTTING;
	spin_unlock(&t->lock);
	nv_put_pages(0, 0, vaddr, nv);
	kref_put(&t->ref, nv_table_free);
	return err;
}

static int nv_unpin(u64 vaddr, struct phx_p2p_page_table *t)
{
	bool ours;
	int err = 0;

	spin_lock(&t->lock);
	ours = t->state == NV_PINNED;
	if (ours)
		t->state = NV_PUTTING;
	spin_unlock(&t->lock);
	complete(&t->released);		/* a racing free callback need not wait */
	if (ours)
		err = nv_put_pages(0, 0, vaddr, t->nv);
	kref_put(&t->ref, nv_table_free);
	return err;
}

static unsigned long nv_get_n_pages(struct phx_p2p_page_table *t)
{
	return t->n;
}

static int nv_get_phys_addrs(struct phx_p2p_page_table *t, u64 *addrs, unsigned long n)
{
	if (n != t->n)
		return -EINVAL;
	memcpy(addrs, t->bus, n * sizeof(*addrs));
	return 0;
}

/* After a reclaim, once the core has revoked and the I/O is done: release the callback. */
static void nv_free_table(struct phx_p2p_page_table *t)
{
	complete(&t->released);
	kref_put(&t->ref, nv_table_free);
}

static struct pci_dev *nv_pci_device(int ordinal)
{
	return ordinal >= 0 && ordinal < nv_ndevs ? nv_devs[ordinal] : NULL;
}

static void nv_put_symbols(void)
{
	if (nv_get_pages)
		symbol_put(nvidia_p2p_get_pages);
	if (nv_put_pages)
		symbol_put(nvidia_p2p_put_pages);
	if (nv_free_page_table)
		symbol_put(nvidia_p2p_free_page_table);
	nv_get_pages = NULL;
	nv_put_pages = NULL;
	nv_free_page_table = NULL;
}

static int nv_init(const char **why)
{
	struct pci_dev *pdev = NULL;

	nv_get_pages = symbol_get(nvidia_p2p_get_pages);
	nv_put_pages = symbol_get(nvidia_p2p_put_pages);
	nv_free_page_table = symbol_get(nvidia_p2p_free_page_table);
	if (!nv_get_pages || !nv_put_pages || !nv_free_page_table) {
		nv_put_symbols();
		*why = "the NVIDIA driver is not loaded (nvidia_p2p_get_pages not found; kernels "
		       "from 6.6 on also refuse symbol_get of non-GPL exports)";
		return -ENOENT;
	}
	/* GPUs: display controllers (VGA, 3D) of vendor NVIDIA, in PCI order */
	while ((pdev = pci_get_device(PCI_VENDOR_ID_NVIDIA, PCI_ANY_ID, pdev))) {
		if ((pdev->class >> 16) != PCI_BASE_CLASS_DISPLAY)
			continue;
		if (nv_ndevs == NV_MAX_DEVS)
			break;
		nv_devs[nv_ndevs++] = pci_dev_get(pdev);
	}
	pci_dev_put(pdev);
	if (!nv_ndevs) {
		nv_put_symbols();
		*why = "the NVIDIA driver is loaded but no NVIDIA GPU was found";
		return -ENODEV;
	}
	return 0;
}

static void nv_exit(void)
{
	while (nv_ndevs)
		pci_dev_put(nv_devs[--nv_ndevs]);
	nv_put_symbols();
}

static const struct phx_p2p_ops nv_ops = {
	.abi_version = PHX_P2P_ABI_VERSION,
	.name = "nvidia",
	.owner = THIS_MODULE,
	.pci_vendor = PCI_VENDOR_ID_NVIDIA,
	.page_size = NV_PAGE_SIZE,
	.init = nv_init,
	.exit = nv_exit,
	.get_pages = nv_pin,
	.put_pages = nv_unpin,
	.get_n_pages = nv_get_n_pages,
	.get_phys_addrs = nv_get_phys_addrs,
	.free_page_table = nv_free_table,
	.pci_device = nv_pci_device,
};

static int __init nv_mod_init(void)
{
	return phx_p2p_register(&nv_ops);
}

static void __exit nv_mod_exit(void)
{
	phx_p2p_unregister(&nv_ops);
}

module_init(nv_mod_init);
module_exit(nv_mod_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Phoenix NVIDIA backend: GPU memory pinned with nvidia_p2p_get_pages");
