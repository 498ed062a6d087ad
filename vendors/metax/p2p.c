// SPDX-License-Identifier: GPL-2.0
/*
 * phx_metax: MetaX's kernel side of the vendor contract (kernel/phx_p2p.h).
 *
 * Vendor side, control plane. GPU memory is pinned with the MetaX driver's P2P API:
 *   get_pages  = metax_p2p_acquire_mem + metax_p2p_get_mem (sg_table of bus addresses)
 *   put_pages  = metax_p2p_put_mem + metax_p2p_release_mem
 *   reclaim    = the callback given to acquire_mem; it must block until I/O into the
 *                memory is done and return 0 (or -ETIMEDOUT): we hand it to the core and
 *                wait for free_page_table, which the core calls once it has revoked the
 *                mappings and no I/O holds the pages.
 * The functions are resolved when the module loads (symbol_get), so it loads on any host
 * and, without the MetaX driver, stays registered as unavailable and says why.
 *
 * The declarations follow the driver's metax_p2p.h as published with its P2P interface
 * (Debian does not ship it). The sg_table's DMA addresses are bus addresses (bus address
 * + metax_p2p_get_bus_offset() = CPU address); entries are page-size aligned. GPU page
 * size 64 KiB; larger driver pages are split into 64 KiB ones.
 *
 * Not tested on hardware here; compile-tested with -Werror and load-tested without the
 * driver in the QEMU test.
 */
#define pr_fmt(fmt) "phx_metax: " fmt

#include <linux/completion.h>
#include <linux/kref.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/spinlock.h>

#include "phx_p2p.h"

/* ---- from metax_p2p.h ------------------------------------------------------------ */

int metax_p2p_acquire_mem(u64 addr, size_t size, void **handle, int (*callback)(void *arg),
			  void *arg);
int metax_p2p_get_mem(void *handle, struct sg_table **sgt);
int metax_p2p_put_mem(void *handle, struct sg_table *sgt);
u64 metax_p2p_get_bus_offset(void *handle);
u32 metax_p2p_get_page_size(void *handle);
void metax_p2p_release_mem(void *handle);

/* ---- the backend ----------------------------------------------------------------- */

#define MX_PCI_VENDOR		0x9999
#define MX_PAGE_SIZE		SZ_64K
#define MX_MAX_DEVS		64
#define MX_RECLAIM_WAIT_MS	10000

static typeof(&metax_p2p_acquire_mem) mx_acquire_mem;
static typeof(&metax_p2p_get_mem) mx_get_mem;
static typeof(&metax_p2p_put_mem) mx_put_mem;
static typeof(&metax_p2p_get_bus_offset) mx_get_bus_offset;
static typeof(&metax_p2p_get_page_size) mx_get_page_size;
static typeof(&metax_p2p_release_mem) mx_release_mem;

static struct pci_dev *mx_devs[MX_MAX_DEVS];
static int mx_ndevs;

enum { MX_PINNED, MX_PUTTING, MX_RECLAIMING };

struct phx_p2p_page_table {
	struct kref ref;		/* the core's, and a running callback's */
	spinlock_t lock;		/* state */
	int state;
	void *handle;
	struct sg_table *sgt;
	u64 vaddr;
	unsigned long n;
	u64 *bus;
	phx_p2p_reclaim_fn reclaim;
	void *data;
	struct completion released;	/* the core is done with the memory */
};

static void mx_table_free(struct kref *ref)
{
	struct phx_p2p_page_table *t = container_of(ref, struct phx_p2p_page_table, ref);

	kvfree(t->bus);
	kfree(t);
}

/* The driver takes the memory back: block until the core is done with it. */
static int mx_callback(void *arg)
{
	struct phx_p2p_page_table *t = arg;
	bool ours;
	int ret = 0;

	spin_lock(&t->lock);
	ours = t->state == MX_PINNED;
	if (ours)
		t->state = MX_RECLAIMING;
	kref_get(&t->ref);
	spin_unlock(&t->lock);
	if (ours) {
		t->reclaim(t->data);
		if (!in_task() ||
		    !wait_for_completion_timeout(&t->released, msecs_to_jiffies(MX_RECLAIM_WAIT_MS)))
			ret = -ETIMEDOUT;
	}
	kref_put(&t->ref, mx_table_free);
	return ret;
}

/* Split the driver's sg_table into 64 KiB bus addresses. */
static int mx_fill_bus(struct phx_p2p_page_table *t)
{
	struct scatterlist *sg;
	unsigned long k = 0;
	unsigned int i;

	for_each_sgtable_dma_sg(t->sgt, sg, i) {
		u64 addr = sg_dma_address(sg);
		u64 len = sg_dma_len(sg), off;

		if (!IS_ALIGNED(addr, MX_PAGE_SIZE) || !IS_ALIGNED(len, MX_PAGE_SIZE))
			return -EINVAL;
		for (off = 0; off < len; off += MX_PAGE_SIZE) {
			if (k == t->n)
				return -EINVAL;
			t->bus[k++] = addr + off;
		}
	}
	return k == t->n ? 0 : -EINVAL;
}

static int mx_pin(u64 vaddr, u64 length, struct phx_p2p_page_table **table,
		  phx_p2p_reclaim_fn reclaim, void *data)
{
	struct phx_p2p_page_table *t;
	u32 page_size;
	int err;

	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return -ENOMEM;
	t->n = length / MX_PAGE_SIZE;
	t->bus = kvcalloc(t->n, sizeof(*t->bus), GFP_KERNEL);
	if (!t->bus) {
		kfree(t);
		return -ENOMEM;
	}
	kref_init(&t->ref);
	spin_lock_init(&t->lock);
	init_completion(&t->released);
	t->state = MX_PINNED;
	t->vaddr = vaddr;
	t->reclaim = reclaim;
	t->data = data;

	err = mx_acquire_mem(vaddr, length, &t->handle, mx_callback, t);
	if (err) {
		kref_put(&t->ref, mx_table_free);
		return err;
	}
	err = mx_get_mem(t->handle, &t->sgt);
	if (err)
		goto release;
	/* bus + offset = CPU address says the driver; the core translates through the BAR */
	pr_debug("[%#llx, +%llu): bus offset %#llx\n", vaddr, length, mx_get_bus_offset(t->handle));
	page_size = mx_get_page_size(t->handle);
	if (!page_size || !is_power_of_2(page_size) || page_size % MX_PAGE_SIZE) {
		pr_err("unsupported GPU page size %u\n", page_size);
		err = -EINVAL;
		goto put;
	}
	err = mx_fill_bus(t);
	if (err) {
		pr_err("sg_table of [%#llx, +%llu) does not hold %lu aligned 64 KiB pages\n", vaddr,
		       length, t->n);
		goto put;
	}
	*table = t;
	return 0;
put:
	mx_put_mem(t->handle, t->sgt);
release:
	spin_lock(&t->lock);
	t->state = MX_PUTTING;
	spin_unlock(&t->lock);
	mx_release_mem(t->handle);
	kref_put(&t->ref, mx_table_free);
	return err;
}

static int mx_unpin(u64 vaddr, struct phx_p2p_page_table *t)
{
	bool ours;
	int err = 0;

	spin_lock(&t->lock);
	ours = t->state == MX_PINNED;
	if (ours)
		t->state = MX_PUTTING;
	spin_unlock(&t->lock);
	complete(&t->released);		/* a racing callback need not wait */
	if (ours) {
		err = mx_put_mem(t->handle, t->sgt);
		mx_release_mem(t->handle);
	}
	kref_put(&t->ref, mx_table_free);
	return err;
}

static unsigned long mx_get_n_pages(struct phx_p2p_page_table *t)
{
	return t->n;
}

static int mx_get_phys_addrs(struct phx_p2p_page_table *t, u64 *addrs, unsigned long n)
{
	if (n != t->n)
		return -EINVAL;
	memcpy(addrs, t->bus, n * sizeof(*addrs));
	return 0;
}

/* After a reclaim, once the core has revoked and the I/O is done: release the callback.
 * The driver owns the handle after its callback: no put_mem or release_mem here. */
static void mx_free_table(struct phx_p2p_page_table *t)
{
	complete(&t->released);
	kref_put(&t->ref, mx_table_free);
}

static struct pci_dev *mx_pci_device(int ordinal)
{
	return ordinal >= 0 && ordinal < mx_ndevs ? mx_devs[ordinal] : NULL;
}

#define MX_SYMBOLS(X) X(acquire_mem) X(get_mem) X(put_mem) X(get_bus_offset) X(get_page_size) \
	X(release_mem)

static void mx_put_symbols(void)
{
#define MX_PUT(name)					\
	if (mx_##name)					\
		symbol_put(metax_p2p_##name);		\
	mx_##name = NULL;
	MX_SYMBOLS(MX_PUT)
#undef MX_PUT
}

static int mx_init(const char **why)
{
	struct pci_dev *pdev = NULL;
	bool missing = false;

#define MX_GET(name)						\
	mx_##name = symbol_get(metax_p2p_##name);		\
	missing |= !mx_##name;
	MX_SYMBOLS(MX_GET)
#undef MX_GET
	if (missing) {
		mx_put_symbols();
		*why = "the MetaX driver is not loaded (metax_p2p_acquire_mem not found)";
		return -ENOENT;
	}
	while ((pdev = pci_get_device(MX_PCI_VENDOR, PCI_ANY_ID, pdev))) {
		u8 base = pdev->class >> 16;

		if (base != PCI_BASE_CLASS_DISPLAY && base != 0x12)	/* processing accelerator */
			continue;
		if (mx_ndevs == MX_MAX_DEVS)
			break;
		mx_devs[mx_ndevs++] = pci_dev_get(pdev);
	}
	pci_dev_put(pdev);
	if (!mx_ndevs) {
		mx_put_symbols();
		*why = "the MetaX driver is loaded but no MetaX GPU (PCI vendor 0x9999) was found";
		return -ENODEV;
	}
	return 0;
}

static void mx_exit(void)
{
	while (mx_ndevs)
		pci_dev_put(mx_devs[--mx_ndevs]);
	mx_put_symbols();
}

static const struct phx_p2p_ops mx_ops = {
	.abi_version = PHX_P2P_ABI_VERSION,
	.name = "metax",
	.owner = THIS_MODULE,
	.pci_vendor = MX_PCI_VENDOR,
	.page_size = MX_PAGE_SIZE,
	.init = mx_init,
	.exit = mx_exit,
	.get_pages = mx_pin,
	.put_pages = mx_unpin,
	.get_n_pages = mx_get_n_pages,
	.get_phys_addrs = mx_get_phys_addrs,
	.free_page_table = mx_free_table,
	.pci_device = mx_pci_device,
};

static int __init mx_mod_init(void)
{
	return phx_p2p_register(&mx_ops);
}

static void __exit mx_mod_exit(void)
{
	phx_p2p_unregister(&mx_ops);
}

module_init(mx_mod_init);
module_exit(mx_mod_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Phoenix MetaX backend: GPU memory pinned with metax_p2p_acquire_mem");
