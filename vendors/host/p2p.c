// SPDX-License-Identifier: GPL-2.0
/*
 * phx_host: the host reference vendor's kernel side. A TEST DOUBLE of an accelerator.
 *
 * Vendor side, control plane: the model of vendors/<name>/p2p.c. The "accelerator" is
 * QEMU's ivshmem-plain device (PCI 1af4:1110): its BAR 2 is memory (a host file or shared
 * memory behind it), so the path is exactly a GPU's: the core makes the BAR ZONE_DEVICE
 * pages, a disk DMAs into it, and the other side (the BAR's own mapping, or the host
 * file) sees the bytes.
 *
 * Device virtual addresses: device N's memory is [va_base * (N + 1), + BAR size), as if
 * each device had its own range of a unified address space (CUDA's UVA). Every process
 * may pin any of it (there is no allocator to own memory here); a range outside it is
 * not device memory (-EINVAL, as the NVIDIA driver answers).
 *
 * Reclaim, for tests: write a device address (or "all") to
 * /sys/module/phx_host/parameters/reclaim and every pinned table covering it is
 * reclaimed, as a GPU driver does when the process frees the memory.
 */
#define pr_fmt(fmt) "phx_host: " fmt

#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/slab.h>

#include "phx_p2p.h"

#define HOST_PAGE_SIZE	SZ_64K		/* as NVIDIA and MetaX: the contract's usual page */
#define HOST_BAR	2		/* ivshmem: BAR 0 registers, BAR 2 shared memory */
#define HOST_MAX_DEVS	16

static unsigned long va_base = 1UL << 40;
module_param(va_base, ulong, 0444);
MODULE_PARM_DESC(va_base, "device N's memory starts at device address va_base * (N + 1)");

struct phx_p2p_page_table {
	struct list_head node;		/* in host_tables while pinned */
	u64 vaddr;
	u64 length;
	u64 bus;			/* bus address of the first page: the range is contiguous */
	phx_p2p_reclaim_fn reclaim;
	void *data;
};

static struct pci_dev *host_devs[HOST_MAX_DEVS];
static int host_ndevs;
/* Held while a reclaim callback runs, so none runs after put_pages() returned. */
static DEFINE_MUTEX(host_lock);
static LIST_HEAD(host_tables);

static int host_get_pages(u64 vaddr, u64 length, struct phx_p2p_page_table **table,
			  phx_p2p_reclaim_fn reclaim, void *data)
{
	struct phx_p2p_page_table *t;
	u64 off, size;
	int i;

	for (i = 0; i < host_ndevs; i++) {
		u64 base = (u64)va_base * (i + 1);

		size = pci_resource_len(host_devs[i], HOST_BAR);
		if (vaddr >= base && vaddr - base < size)
			break;
	}
	if (i == host_ndevs)
		return -EINVAL;			/* not device memory */
	off = vaddr - (u64)va_base * (i + 1);
	if (length > size - off)
		return -EINVAL;			/* runs past the device's memory */

	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return -ENOMEM;
	t->vaddr = vaddr;
	t->length = length;
	t->bus = pci_bus_address(host_devs[i], HOST_BAR) + off;
	t->reclaim = reclaim;
	t->data = data;
	mutex_lock(&host_lock);
	list_add(&t->node, &host_tables);
	mutex_unlock(&host_lock);
	*table = t;
	return 0;
}

static int host_put_pages(u64 vaddr, struct phx_p2p_page_table *t)
{
	if (vaddr != t->vaddr)
		return -EINVAL;
	mutex_lock(&host_lock);
	list_del_init(&t->node);	/* off the list already if a reclaim lost the race */
	mutex_unlock(&host_lock);
	kfree(t);
	return 0;
}

static unsigned long host_get_n_pages(struct phx_p2p_page_table *t)
{
	return t->length / HOST_PAGE_SIZE;
}

static int host_get_phys_addrs(struct phx_p2p_page_table *t, u64 *addrs, unsigned long n)
{
	unsigned long i;

	if (n != host_get_n_pages(t))
		return -EINVAL;
	for (i = 0; i < n; i++)
		addrs[i] = t->bus + (u64)i * HOST_PAGE_SIZE;
	return 0;
}

static void host_free_page_table(struct phx_p2p_page_table *t)
{
	kfree(t);
}

static struct pci_dev *host_pci_device(int ordinal)
{
	return ordinal >= 0 && ordinal < host_ndevs ? host_devs[ordinal] : NULL;
}

static const struct phx_p2p_ops host_ops = {
	.abi_version = PHX_P2P_ABI_VERSION,
	.name = "host",
	.owner = THIS_MODULE,
	.pci_vendor = PCI_VENDOR_ID_REDHAT_QUMRANET,
	.page_size = HOST_PAGE_SIZE,
	.get_pages = host_get_pages,
	.put_pages = host_put_pages,
	.get_n_pages = host_get_n_pages,
	.get_phys_addrs = host_get_phys_addrs,
	.free_page_table = host_free_page_table,
	.pci_device = host_pci_device,
};

/* Reclaim every table covering a device address ("all": every table). */
static int host_reclaim_set(const char *val, const struct kernel_param *kp)
{
	struct phx_p2p_page_table *t, *tmp;
	bool all = sysfs_streq(val, "all");
	u64 va = 0;
	int n = 0;

	if (!all && kstrtou64(val, 0, &va))
		return -EINVAL;
	mutex_lock(&host_lock);
	list_for_each_entry_safe(t, tmp, &host_tables, node) {
		if (!all && (va < t->vaddr || va - t->vaddr >= t->length))
			continue;
		list_del_init(&t->node);
		t->reclaim(t->data);	/* the core frees the table with free_page_table */
		n++;
	}
	mutex_unlock(&host_lock);
	if (n)
		pr_info_ratelimited("reclaimed %d table(s)\n", n);
	return 0;
}

static const struct kernel_param_ops host_reclaim_ops = {
	.set = host_reclaim_set,
};
module_param_cb(reclaim, &host_reclaim_ops, NULL, 0200);
MODULE_PARM_DESC(reclaim, "write a device address or \"all\": reclaim the tables covering it (tests)");

static int host_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	int err;

	if (host_ndevs == HOST_MAX_DEVS)
		return -ENOSPC;
	if (!(pci_resource_flags(pdev, HOST_BAR) & IORESOURCE_MEM) ||
	    pci_resource_len(pdev, HOST_BAR) < HOST_PAGE_SIZE)
		return -ENODEV;
	err = pci_enable_device_mem(pdev);
	if (err)
		return err;
	err = pci_request_region(pdev, HOST_BAR, "phx_host");
	if (err) {
		pci_disable_device(pdev);
		return err;
	}
	host_devs[host_ndevs++] = pdev;
	dev_info(&pdev->dev, "fake accelerator %d: %llu MiB of device memory at device address %#llx (test double)\n",
		 host_ndevs - 1, (u64)pci_resource_len(pdev, HOST_BAR) >> 20,
		 (u64)va_base * host_ndevs);
	return 0;
}

static void host_remove(struct pci_dev *pdev)
{
	/* Only at module unload (no manual unbind), after phx_p2p_unregister(). */
	pci_release_region(pdev, HOST_BAR);
	pci_disable_device(pdev);
}

static const struct pci_device_id host_ids[] = {
	{ PCI_DEVICE(PCI_VENDOR_ID_REDHAT_QUMRANET, 0x1110) },	/* ivshmem */
	{ }
};
MODULE_DEVICE_TABLE(pci, host_ids);

static struct pci_driver host_driver = {
	.name = "phx_host",
	.id_table = host_ids,
	.probe = host_probe,
	.remove = host_remove,
	.driver.suppress_bind_attrs = true,	/* the core holds the device until unload */
};

static int __init host_init(void)
{
	int err;

	if (!va_base || va_base & (HOST_PAGE_SIZE - 1))
		return -EINVAL;
	err = pci_register_driver(&host_driver);
	if (err)
		return err;
	err = phx_p2p_register(&host_ops);
	if (err)
		pci_unregister_driver(&host_driver);
	return err;
}

static void __exit host_exit(void)
{
	phx_p2p_unregister(&host_ops);
	pci_unregister_driver(&host_driver);
}

module_init(host_init);
module_exit(host_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Phoenix host reference vendor, kernel side: QEMU ivshmem as a fake accelerator (test double)");
