// SPDX-License-Identifier: GPL-2.0
/*
 * phx_core: the core of Phoenix's direct path. Core side, control plane.
 *
 * Device memory becomes ordinary struct pages, so that O_DIRECT pread/pwrite on a user
 * address that maps it goes through the file system, the block layer and the disk's
 * driver, and the disk DMAs straight into (or out of) device memory.
 *
 *   vendor backend (vendors/<name>/p2p.c, its own module)
 *       registers a struct phx_p2p_ops (kernel/phx_p2p.h): pins device virtual memory,
 *       hands back bus addresses, and calls back when the vendor reclaims memory.
 *   this module
 *       per accelerator: the device's largest BAR becomes ZONE_DEVICE pages
 *       (memremap_pages, MEMORY_DEVICE_GENERIC as device-DAX uses: Debian's kernels have
 *       neither PCI_P2PDMA nor DEVICE_PRIVATE), a character device /dev/phx_<vendor><N>
 *       and its sysfs attributes; per MAP ioctl: pin through the backend, check every
 *       bus address lies in that BAR, and map the pages into the caller (devmap PTEs
 *       inserted at fault time, which get_user_pages and so O_DIRECT accept).
 *
 * Lifetimes (what must stay true):
 *   - A mapping (struct phx_map) belongs to one open file and to the process that
 *     opened it (other processes get EPERM; the VMA is not inherited across fork).
 *   - Before a pinned table goes back to the vendor (put_pages) or the BAR's pages go
 *     away (memunmap_pages), the user PTEs are zapped and every page's reference count
 *     is back to its idle value: in-flight O_DIRECT I/O holds page references, and the
 *     device memory must not be reused while a disk still DMAs into it. A mapping whose
 *     pages stay referenced (a pipe holding them after vmsplice, ...) is parked and
 *     retried by a reaper instead of blocking the caller; unregister waits for it.
 *   - A vendor reclaim revokes at once: later faults get SIGBUS and I/O gets EFAULT.
 *
 * Locks, outermost first: phx_lock (backend list) > pd->lock (device's files) >
 * pf->lock (file's mappings) > mmap_lock > m->lock (pin vs reclaim work) >
 * m->fault_sem (revoked flag vs fault) > i_mmap_rwsem (unmap_mapping_range).
 */
#define pr_fmt(fmt) "phx_core: " fmt

#include <linux/cdev.h>
#include <linux/delay.h>
#include <linux/device.h>
#include <linux/fs.h>
#include <linux/idr.h>
#include <linux/io.h>
#include <linux/maple_tree.h>
#include <linux/memremap.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/pfn_t.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>

#include "phx_ioctl.h"
#include "phx_p2p.h"

#define PHX_MAX_MINORS		256
#define PHX_MAX_DEVS		64		/* per backend */
#define PHX_MAX_MAPS		65536		/* per open file */
/* Each mapping's mmap offsets live in their own slot of 2^28 pages (1 TiB): one MAP is at
 * most that long, and the offset names the mapping (the handle). */
#define PHX_SLOT_SHIFT		28
#define PHX_SLOT_BYTES_SHIFT	(PHX_SLOT_SHIFT + PAGE_SHIFT)
#define PHX_MAX_MAP_BYTES	(1ULL << PHX_SLOT_BYTES_SHIFT)
#define PHX_MAX_IDS		(1 << 20)
/* How long UNMAP waits for in-flight I/O to drop its page references before parking. */
#define PHX_UNMAP_WAIT_MS	200
#define PHX_REAP_MS		100
/* How long a vendor reclaim waits for in-flight I/O before freeing the table anyway. */
#define PHX_RECLAIM_WAIT_MS	5000

#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
#define phx_vm_flags_set(vma, f)	vm_flags_set(vma, f)
#define phx_vm_flags_clear(vma, f)	vm_flags_clear(vma, f)
#else
#define phx_vm_flags_set(vma, f)	((vma)->vm_flags |= (f))
#define phx_vm_flags_clear(vma, f)	((vma)->vm_flags &= ~(f))
#endif
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 4, 0)
#define PHX_CLASS_CONST const
#else
#define PHX_CLASS_CONST
#endif

struct phx_backend {
	struct list_head node;			/* in phx_backends */
	const struct phx_p2p_ops *ops;
	int status;				/* 0: serving; else init()'s errno */
	const char *why;			/* init()'s reason, when status != 0 */
	char note[96];				/* devices that could not be attached */
	int ndevs;
	struct phx_dev *devs[PHX_MAX_DEVS];
};

/* One accelerator: its BAR as ZONE_DEVICE pages and its character device. */
struct phx_dev {
	struct device dev;			/* /sys/class/phx/phx_<vendor><N>; frees us */
	struct cdev cdev;
	struct phx_backend *be;
	const struct phx_p2p_ops *ops;
	int ordinal;
	struct pci_dev *pdev;
	int bar;
	phys_addr_t bar_phys;			/* CPU physical address of the BAR */
	u64 bar_bus;				/* its bus address (what backends return) */
	resource_size_t bar_size;
	struct dev_pagemap pgmap;

	struct mutex lock;			/* files, dead */
	bool dead;
	struct list_head files;

	spinlock_t zlock;			/* zombies */
	struct list_head zombies;		/* mappings waiting for their pages to idle */
	struct delayed_work reaper;

	atomic_t nmaps;
	atomic64_t pinned_bytes;
	atomic64_t reclaims;
	atomic64_t faults;
};

/* One open file: a process's context on one device. */
struct phx_file {
	struct kref ref;			/* the file, and each mapping */
	struct phx_dev *pd;			/* holds a device reference */
	struct mm_struct *mm;			/* the opener's; grabbed */
	struct inode *inode;			/* held: its i_mapping holds our VMAs */
	struct file *file;			/* valid until release */
	struct mutex lock;			/* maps, ranges, nmaps */
	struct xarray maps;			/* mapping id -> struct phx_map */
	struct maple_tree ranges;		/* device VA range -> struct phx_map (no overlap) */
	unsigned int nmaps;
	struct list_head node;			/* in pd->files */
};

enum { PHX_TBL_NONE, PHX_TBL_PINNED, PHX_TBL_PUT, PHX_TBL_RECLAIMED };

/* One MAP: a pinned device range and the user mapping of its pages. */
struct phx_map {
	struct kref ref;	/* the file's table, the pinned vendor table, each VMA */
	struct phx_file *pf;	/* holds a file reference */
	struct phx_dev *pd;
	u32 id;
	unsigned long pgoff;	/* mmap offset in pages: id << PHX_SLOT_SHIFT */
	u64 dev_va;
	u64 length;
	unsigned long addr;	/* user address from MAP */
	struct task_struct *mmapper;	/* set only while MAP itself mmaps */

	struct mutex lock;	/* pinning vs the reclaim work */
	atomic_t tbl_state;	/* PHX_TBL_* */
	struct phx_p2p_page_table *table;
	unsigned long n_p2p;	/* backend pages */
	unsigned int p2p_shift;	/* log2(page_size) */
	phys_addr_t *phys;	/* CPU physical address of each backend page */
	bool phys_valid;	/* phys[] filled and checked (set under lock) */

	struct rw_semaphore fault_sem;	/* revoked vs faults inserting PTEs */
	bool revoked;
	atomic_t vmas;

	struct work_struct reclaim_work;
	struct list_head zombie;	/* in pd->zombies */
	struct rcu_head rcu;		/* freed after a grace period: phx_mmap looks up locklessly */
};

static DEFINE_MUTEX(phx_lock);
static LIST_HEAD(phx_backends);
static DEFINE_IDA(phx_minors);
/* Mapping ids (and so handles and mmap offsets), unique across files and allocated
 * cyclically, so a stale handle does not name a newer mapping. */
static DEFINE_XARRAY_ALLOC1(phx_ids);
static u32 phx_next_id;
static dev_t phx_devt;
static struct class *phx_class;
static struct workqueue_struct *phx_wq;

static const struct vm_operations_struct phx_vm_ops;

/* ---- mappings -------------------------------------------------------------------- */

static void phx_file_free(struct kref *ref);

static void phx_map_free(struct kref *ref)
{
	struct phx_map *m = container_of(ref, struct phx_map, ref);

	xa_erase(&phx_ids, m->id);
	kvfree(m->phys);
	kref_put(&m->pf->ref, phx_file_free);
	kfree_rcu(m, rcu);
}

static void phx_map_put(struct phx_map *m)
{
	kref_put(&m->ref, phx_map_free);
}

/* Revoke the user mapping: later faults get SIGBUS, and existing PTEs go. Idempotent. */
static void phx_map_revoke(struct phx_map *m)
{
	down_write(&m->fault_sem);
	m->revoked = true;
	up_write(&m->fault_sem);
	/* No fault can insert a PTE from here on; zap those that exist, in every VMA. */
	unmap_mapping_range(m->pf->inode->i_mapping, (loff_t)m->pgoff << PAGE_SHIFT,
			    m->length, 1);
}

/* CPU physical address of byte off of the mapping (off < length). */
static phys_addr_t phx_map_phys(struct phx_map *m, u64 off)
{
	return m->phys[off >> m->p2p_shift] + (off & ((1ULL << m->p2p_shift) - 1));
}

static struct page *phx_map_page(struct phx_map *m, u64 off)
{
	return pfn_to_page(PHYS_PFN(phx_map_phys(m, off)));
}

/*
 * Does anyone besides the ZONE_DEVICE page itself hold one of the mapping's pages?
 * MEMORY_DEVICE_GENERIC pages idle at a reference count of 1; get_user_pages adds one
 * per pin (O_DIRECT in flight, a pipe after vmsplice, ...).
 */
static bool phx_map_pages_busy(struct phx_map *m)
{
	u64 off;

	if (!m->phys_valid)
		return false;			/* never mapped: no page can be referenced */
	for (off = 0; off < m->length; off += PAGE_SIZE) {
		if (page_ref_count(phx_map_page(m, off)) > 1)
			return true;
		if (!(off & ((1UL << 24) - 1)))
			cond_resched();
	}
	return false;
}

/* Give the table back to the vendor; the pages are idle and the PTEs gone. */
static void phx_map_put_pages(struct phx_map *m)
{
	const struct phx_p2p_ops *ops = m->pd->ops;
	int err;

	err = ops->put_pages(m->dev_va, m->table);
	if (err)
		pr_err("%s: put_pages(%#llx, %llu) failed: %d\n", dev_name(&m->pd->dev),
		       m->dev_va, m->length, err);
	m->table = NULL;
	atomic64_sub(m->length, &m->pd->pinned_bytes);
	module_put(ops->owner);
	phx_map_put(m);				/* the table's reference */
}

static void phx_reap(struct work_struct *work);

/*
 * Unpin a mapping taken out of its file's table: revoke, wait up to wait_ms for its
 * pages to idle, then put_pages (or, when still busy, park it on the device's zombie
 * list for the reaper). Consumes the caller's reference.
 */
static void phx_map_destroy(struct phx_map *m, unsigned int wait_ms)
{
	struct phx_dev *pd = m->pd;
	unsigned long deadline = jiffies + msecs_to_jiffies(wait_ms);

	phx_map_revoke(m);
	atomic_dec(&pd->nmaps);
	if (atomic_read(&m->tbl_state) == PHX_TBL_PINNED) {
		while (phx_map_pages_busy(m)) {
			if (time_after(jiffies, deadline)) {
				spin_lock(&pd->zlock);
				list_add_tail(&m->zombie, &pd->zombies);	/* our reference */
				spin_unlock(&pd->zlock);
				queue_delayed_work(phx_wq, &pd->reaper, msecs_to_jiffies(PHX_REAP_MS));
				return;
			}
			usleep_range(500, 1000);
		}
		if (atomic_cmpxchg(&m->tbl_state, PHX_TBL_PINNED, PHX_TBL_PUT) == PHX_TBL_PINNED)
			phx_map_put_pages(m);
	}
	/* Reclaimed: the work frees the table; let it finish so teardown is complete. */
	if (atomic_read(&m->tbl_state) == PHX_TBL_RECLAIMED)
		flush_work(&m->reclaim_work);
	phx_map_put(m);
}

static void phx_reap(struct work_struct *work)
{
	struct phx_dev *pd = container_of(to_delayed_work(work), struct phx_dev, reaper);
	struct phx_map *m, *tmp;
	LIST_HEAD(done);
	bool more;

	spin_lock(&pd->zlock);
	list_splice_init(&pd->zombies, &done);
	spin_unlock(&pd->zlock);

	list_for_each_entry_safe(m, tmp, &done, zombie) {
		if (atomic_read(&m->tbl_state) == PHX_TBL_PINNED && phx_map_pages_busy(m))
			continue;			/* still busy: back on the list below */
		list_del(&m->zombie);
		if (atomic_cmpxchg(&m->tbl_state, PHX_TBL_PINNED, PHX_TBL_PUT) == PHX_TBL_PINNED)
			phx_map_put_pages(m);
		if (atomic_read(&m->tbl_state) == PHX_TBL_RECLAIMED)
			flush_work(&m->reclaim_work);
		phx_map_put(m);
	}

	spin_lock(&pd->zlock);
	list_splice(&done, &pd->zombies);
	more = !list_empty(&pd->zombies);
	spin_unlock(&pd->zlock);
	if (more)
		queue_delayed_work(phx_wq, &pd->reaper, msecs_to_jiffies(PHX_REAP_MS));
}

/* The vendor takes the memory back: revoke and free the table (backend callback). */
static void phx_reclaim(void *data)
{
	struct phx_map *m = data;

	if (atomic_cmpxchg(&m->tbl_state, PHX_TBL_PINNED, PHX_TBL_RECLAIMED) == PHX_TBL_PINNED)
		queue_work(phx_wq, &m->reclaim_work);
}

static void phx_reclaim_work(struct work_struct *work)
{
	struct phx_map *m = container_of(work, struct phx_map, reclaim_work);
	const struct phx_p2p_ops *ops = m->pd->ops;

	unsigned long deadline = jiffies + msecs_to_jiffies(PHX_RECLAIM_WAIT_MS);

	mutex_lock(&m->lock);			/* MAP may still be pinning this table */
	phx_map_revoke(m);
	/* Let DMA already in flight finish before the vendor reuses the memory (a backend's
	 * callback may wait for free_page_table to know that). Bounded: the vendor decides. */
	while (m->table && phx_map_pages_busy(m)) {
		if (time_after(jiffies, deadline)) {
			pr_warn("%s: vendor reclaimed [%#llx, +%llu) with I/O still in flight\n",
				dev_name(&m->pd->dev), m->dev_va, m->length);
			break;
		}
		usleep_range(500, 1000);
	}
	ops->free_page_table(m->table);
	m->table = NULL;
	mutex_unlock(&m->lock);
	atomic64_inc(&m->pd->reclaims);
	atomic64_sub(m->length, &m->pd->pinned_bytes);
	pr_info_ratelimited("%s: vendor reclaimed [%#llx, +%llu): mapping revoked\n", dev_name(&m->pd->dev),
		m->dev_va, m->length);
	module_put(ops->owner);
	phx_map_put(m);				/* the table's reference */
}

/* Pin through the backend and check the bus addresses. Called with m->lock held. */
static int phx_map_pin(struct phx_map *m)
{
	struct phx_dev *pd = m->pd;
	const struct phx_p2p_ops *ops = pd->ops;
	struct phx_p2p_page_table *table = NULL;
	unsigned long n, i;
	u64 *addrs;
	int err;

	addrs = kvcalloc(m->n_p2p, sizeof(*addrs), GFP_KERNEL);
	if (!addrs)
		return -ENOMEM;
	if (!try_module_get(ops->owner)) {
		kvfree(addrs);
		return -ENODEV;
	}
	kref_get(&m->ref);			/* the table's: until put_pages or free_page_table */
	atomic_set(&m->tbl_state, PHX_TBL_PINNED);
	err = ops->get_pages(m->dev_va, m->length, &table, phx_reclaim, m);
	if (err || !table) {
		atomic_set(&m->tbl_state, PHX_TBL_NONE);
		module_put(ops->owner);
		kref_put(&m->ref, phx_map_free);	/* never the last: the caller holds one */
		kvfree(addrs);
		return err ? err : -EIO;
	}
	m->table = table;
	atomic64_add(m->length, &pd->pinned_bytes);

	err = -EINVAL;
	n = ops->get_n_pages(table);
	if (n != m->n_p2p) {
		pr_warn("%s: backend returned %lu pages for %llu bytes (page size %lu)\n",
			dev_name(&pd->dev), n, m->length, ops->page_size);
		goto out;
	}
	err = ops->get_phys_addrs(table, addrs, n);
	if (err)
		goto out;
	for (i = 0; i < n; i++) {
		u64 bus = addrs[i];

		if (!IS_ALIGNED(bus, ops->page_size) || bus < pd->bar_bus ||
		    bus - pd->bar_bus > pd->bar_size - ops->page_size) {
			pr_warn("%s: backend page %lu at bus address %#llx is outside BAR %d\n",
				dev_name(&pd->dev), i, bus, pd->bar);
			err = -EINVAL;		/* memory of another device, or a broken backend */
			goto out;
		}
		m->phys[i] = pd->bar_phys + (bus - pd->bar_bus);
	}
	m->phys_valid = true;
	err = 0;
out:
	kvfree(addrs);
	return err;
}

/* ---- the user mapping ------------------------------------------------------------ */

static vm_fault_t phx_vm_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct phx_map *m = vma->vm_private_data;
	u64 off = vmf->address - vma->vm_start;
	unsigned long start, end, addr;
	vm_fault_t ret;

	if (vma->vm_mm != m->pf->mm || off >= m->length)
		return VM_FAULT_SIGBUS;
	down_read(&m->fault_sem);
	if (m->revoked) {
		up_read(&m->fault_sem);
		return VM_FAULT_SIGBUS;
	}
	/* A devmap PTE: vm_normal_page() skips it, get_user_pages() takes the page. */
	ret = vmf_insert_mixed(vma, vmf->address,
			       phys_to_pfn_t(phx_map_phys(m, off), PFN_DEV | PFN_MAP));
	/*
	 * Fault around: map the rest of the 2 MiB block too, so that touching or pinning
	 * a large buffer costs a fault per 512 pages, not one per page. (PMD entries would
	 * be better, but 6.1 gives huge faults to no VM_SPECIAL VMA except DAX files.)
	 */
	start = max(vma->vm_start, vmf->address & PMD_MASK);
	end = min(vma->vm_end, (vmf->address & PMD_MASK) + PMD_SIZE);
	for (addr = start; ret == VM_FAULT_NOPAGE && addr < end; addr += PAGE_SIZE) {
		if (addr == (vmf->address & PAGE_MASK))
			continue;
		if (vmf_insert_mixed(vma, addr, phys_to_pfn_t(phx_map_phys(m, addr - vma->vm_start),
							      PFN_DEV | PFN_MAP)) != VM_FAULT_NOPAGE)
			break;			/* the faulting page is in; the rest can fault later */
	}
	up_read(&m->fault_sem);
	atomic64_inc(&m->pd->faults);
	return ret;
}

static void phx_vm_open(struct vm_area_struct *vma)
{
	struct phx_map *m = vma->vm_private_data;

	kref_get(&m->ref);
	atomic_inc(&m->vmas);
}

static void phx_vm_close(struct vm_area_struct *vma)
{
	struct phx_map *m = vma->vm_private_data;

	atomic_dec(&m->vmas);
	phx_map_put(m);
}

/* One VMA per mapping, whole: no partial munmap/mprotect, no mremap. */
static int phx_vm_may_split(struct vm_area_struct *vma, unsigned long addr)
{
	return -EINVAL;
}

static int phx_vm_mremap(struct vm_area_struct *vma)
{
	return -EINVAL;
}

static const struct vm_operations_struct phx_vm_ops = {
	.open = phx_vm_open,
	.close = phx_vm_close,
	.fault = phx_vm_fault,
	.may_split = phx_vm_may_split,
	.mremap = phx_vm_mremap,
};

static int phx_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct phx_file *pf = file->private_data;
	struct phx_map *m;
	bool ours;

	if (vma->vm_pgoff & ((1UL << PHX_SLOT_SHIFT) - 1))
		return -EINVAL;
	/*
	 * Only MAP maps (it sets mmapper around its vm_mmap): a mapping has exactly one VMA,
	 * made by its owner. pf->lock cannot be taken here (MAP holds it across vm_mmap, which
	 * takes mmap_lock), so look up under RCU: a mapping is freed after a grace period, and
	 * once mmapper is us, MAP's reference keeps it.
	 */
	rcu_read_lock();
	m = xa_load(&pf->maps, vma->vm_pgoff >> PHX_SLOT_SHIFT);
	ours = m && READ_ONCE(m->mmapper) == current;
	rcu_read_unlock();
	if (!ours || vma->vm_mm != pf->mm)
		return -EINVAL;
	if (vma->vm_end - vma->vm_start != m->length || !(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	if (vma->vm_flags & VM_EXEC)
		return -EPERM;
	phx_vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP | VM_DONTCOPY);
	phx_vm_flags_clear(vma, VM_MAYEXEC);
	vma->vm_ops = &phx_vm_ops;
	vma->vm_private_data = m;
	phx_vm_open(vma);
	return 0;
}

/* Remove the VMA MAP made, if the process still has it as it was. */
static void phx_map_unmap_user(struct phx_map *m)
{
	struct mm_struct *mm = current->mm;
	struct vm_area_struct *vma;
	bool ours;

	if (!m->addr || mm != m->pf->mm)
		return;
	mmap_read_lock(mm);
	vma = vma_lookup(mm, m->addr);
	ours = vma && vma->vm_ops == &phx_vm_ops && vma->vm_private_data == m &&
	       vma->vm_start == m->addr && vma->vm_end - vma->vm_start == m->length;
	mmap_read_unlock(mm);
	if (ours)
		vm_munmap(m->addr, m->length);
}

/* ---- ioctls ---------------------------------------------------------------------- */

static long phx_ioc_info(struct phx_file *pf, void __user *uarg)
{
	struct phx_dev *pd = pf->pd;
	struct phx_info_args a = {
		.abi = PHX_IOCTL_ABI,
		.ordinal = pd->ordinal,
		.page_size = pd->ops->page_size,
		.bar_size = pd->bar_size,
		.max_map = min_t(u64, pd->bar_size, PHX_MAX_MAP_BYTES),
	};

	strscpy(a.vendor, pd->ops->name, sizeof(a.vendor));
	return copy_to_user(uarg, &a, sizeof(a)) ? -EFAULT : 0;
}

/* Take a mapping out of its file's tables. Called with pf->lock held. */
static void phx_file_forget(struct phx_file *pf, struct phx_map *m)
{
	xa_erase(&pf->maps, m->id);
	mtree_erase(&pf->ranges, m->dev_va);
	pf->nmaps--;
}

static long phx_ioc_unmap_one(struct phx_file *pf, u64 handle)
{
	struct phx_map *m;

	if (!handle || (handle & ((1ULL << PHX_SLOT_BYTES_SHIFT) - 1)) ||
	    (handle >> PHX_SLOT_BYTES_SHIFT) >= PHX_MAX_IDS)
		return -EINVAL;
	mutex_lock(&pf->lock);
	m = xa_load(&pf->maps, handle >> PHX_SLOT_BYTES_SHIFT);
	if (m)
		phx_file_forget(pf, m);
	mutex_unlock(&pf->lock);
	if (!m)
		return -EINVAL;			/* not a mapping of this file */
	phx_map_unmap_user(m);
	phx_map_destroy(m, PHX_UNMAP_WAIT_MS);	/* the file table's reference */
	return 0;
}

static long phx_ioc_map(struct phx_file *pf, struct phx_map_args __user *uarg)
{
	struct phx_dev *pd = pf->pd;
	const struct phx_p2p_ops *ops = pd->ops;
	struct phx_map_args a;
	struct phx_map *m;
	unsigned long addr;
	u64 last;
	u32 id;
	int err;

	if (copy_from_user(&a, uarg, sizeof(a)))
		return -EFAULT;
	if (a.flags || a.pad)
		return -EINVAL;
	if (!a.length || !IS_ALIGNED(a.dev_va, ops->page_size) ||
	    !IS_ALIGNED(a.length, ops->page_size))
		return -EINVAL;
	if (check_add_overflow(a.dev_va, a.length - 1, &last))
		return -EOVERFLOW;
	if (a.length > min_t(u64, pd->bar_size, PHX_MAX_MAP_BYTES))
		return -EINVAL;			/* more than the device can map */

	m = kzalloc(sizeof(*m), GFP_KERNEL);
	if (!m)
		return -ENOMEM;
	err = xa_alloc_cyclic(&phx_ids, &id, m, XA_LIMIT(1, PHX_MAX_IDS - 1), &phx_next_id,
			      GFP_KERNEL);
	if (err < 0) {
		kfree(m);
		return err == -EBUSY ? -ENOSPC : err;
	}
	kref_init(&m->ref);			/* the file table's */
	kref_get(&pf->ref);
	m->pf = pf;
	m->pd = pd;
	m->id = id;
	m->pgoff = (unsigned long)id << PHX_SLOT_SHIFT;
	m->dev_va = a.dev_va;
	m->length = a.length;
	m->p2p_shift = ilog2(ops->page_size);
	m->n_p2p = a.length >> m->p2p_shift;
	mutex_init(&m->lock);
	init_rwsem(&m->fault_sem);
	INIT_WORK(&m->reclaim_work, phx_reclaim_work);
	INIT_LIST_HEAD(&m->zombie);
	m->phys = kvcalloc(m->n_p2p, sizeof(*m->phys), GFP_KERNEL);
	if (!m->phys) {
		phx_map_put(m);
		return -ENOMEM;
	}

	mutex_lock(&pf->lock);
	err = -ENODEV;
	if (READ_ONCE(pd->dead))
		goto unlock_free;
	err = -ENOSPC;
	if (pf->nmaps >= PHX_MAX_MAPS)
		goto unlock_free;
	err = mtree_insert_range(&pf->ranges, a.dev_va, last, m, GFP_KERNEL);
	if (err)				/* -EEXIST: overlaps a mapping of this file */
		goto unlock_free;
	err = xa_insert(&pf->maps, id, m, GFP_KERNEL);
	if (err) {
		mtree_erase(&pf->ranges, a.dev_va);
		goto unlock_free;
	}
	pf->nmaps++;
	atomic_inc(&pd->nmaps);

	mutex_lock(&m->lock);
	err = phx_map_pin(m);
	if (!err && atomic_read(&m->tbl_state) != PHX_TBL_PINNED)
		err = -EAGAIN;			/* reclaimed while we pinned */
	mutex_unlock(&m->lock);
	if (err)
		goto unlock_destroy;

	WRITE_ONCE(m->mmapper, current);
	addr = vm_mmap(pf->file, 0, a.length, PROT_READ | PROT_WRITE, MAP_SHARED,
		       (unsigned long)m->pgoff << PAGE_SHIFT);
	WRITE_ONCE(m->mmapper, NULL);
	if (IS_ERR_VALUE(addr)) {
		err = (long)addr;
		goto unlock_destroy;
	}
	m->addr = addr;
	mutex_unlock(&pf->lock);

	a.handle = (u64)m->pgoff << PAGE_SHIFT;
	a.addr = addr;
	if (copy_to_user(uarg, &a, sizeof(a))) {
		phx_ioc_unmap_one(pf, a.handle);
		return -EFAULT;
	}
	return 0;

unlock_destroy:
	phx_file_forget(pf, m);
	mutex_unlock(&pf->lock);
	phx_map_destroy(m, PHX_UNMAP_WAIT_MS);
	return err;
unlock_free:
	mutex_unlock(&pf->lock);
	phx_map_put(m);
	return err;
}

static long phx_ioc_unmap(struct phx_file *pf, struct phx_unmap_args __user *uarg)
{
	struct phx_unmap_args a;

	if (copy_from_user(&a, uarg, sizeof(a)))
		return -EFAULT;
	if (a.flags || a.pad)
		return -EINVAL;
	return phx_ioc_unmap_one(pf, a.handle);
}

static long phx_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct phx_file *pf = file->private_data;
	void __user *uarg = (void __user *)arg;

	if (current->mm != pf->mm)
		return -EPERM;			/* another process (a fork child, ...) */
	if (READ_ONCE(pf->pd->dead))
		return -ENODEV;
	switch (cmd) {
	case PHX_IOC_INFO:
		return phx_ioc_info(pf, uarg);
	case PHX_IOC_MAP:
		return phx_ioc_map(pf, uarg);
	case PHX_IOC_UNMAP:
		return phx_ioc_unmap(pf, uarg);
	default:
		return -ENOTTY;
	}
}

/* ---- files ----------------------------------------------------------------------- */

static void phx_file_free(struct kref *ref)
{
	struct phx_file *pf = container_of(ref, struct phx_file, ref);

	mtree_destroy(&pf->ranges);
	xa_destroy(&pf->maps);
	iput(pf->inode);
	mmdrop(pf->mm);
	put_device(&pf->pd->dev);
	kfree(pf);
}

/* Unpin every mapping of a file (release, or the device going away). */
static void phx_file_teardown(struct phx_file *pf, unsigned int wait_ms)
{
	struct phx_map *m;
	unsigned long id;

	mutex_lock(&pf->lock);
	xa_for_each(&pf->maps, id, m) {
		phx_file_forget(pf, m);
		phx_map_destroy(m, wait_ms);
	}
	mutex_unlock(&pf->lock);
}

static int phx_open(struct inode *inode, struct file *file)
{
	struct phx_dev *pd = container_of(inode->i_cdev, struct phx_dev, cdev);
	struct phx_file *pf;

	if (!current->mm)
		return -EINVAL;
	pf = kzalloc(sizeof(*pf), GFP_KERNEL);
	if (!pf)
		return -ENOMEM;
	kref_init(&pf->ref);
	mutex_init(&pf->lock);
	xa_init_flags(&pf->maps, 0);
	mt_init(&pf->ranges);
	INIT_LIST_HEAD(&pf->node);
	pf->pd = pd;
	get_device(&pd->dev);
	pf->mm = current->mm;
	mmgrab(pf->mm);
	pf->inode = igrab(inode);
	pf->file = file;
	if (!pf->inode) {
		kref_put(&pf->ref, phx_file_free);
		return -ENODEV;
	}

	mutex_lock(&pd->lock);
	if (pd->dead) {
		mutex_unlock(&pd->lock);
		kref_put(&pf->ref, phx_file_free);
		return -ENODEV;
	}
	list_add(&pf->node, &pd->files);
	mutex_unlock(&pd->lock);
	file->private_data = pf;
	return 0;
}

static int phx_release(struct inode *inode, struct file *file)
{
	struct phx_file *pf = file->private_data;
	struct phx_dev *pd = pf->pd;

	mutex_lock(&pd->lock);
	list_del_init(&pf->node);
	mutex_unlock(&pd->lock);
	/* No VMA is left (each holds the file), so nothing waits on us: don't wait long. */
	phx_file_teardown(pf, 20);
	pf->file = NULL;
	kref_put(&pf->ref, phx_file_free);
	return 0;
}

static const struct file_operations phx_fops = {
	.owner = THIS_MODULE,
	.open = phx_open,
	.release = phx_release,
	.unlocked_ioctl = phx_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.mmap = phx_mmap,
	.llseek = noop_llseek,
};

/* ---- devices --------------------------------------------------------------------- */

static struct phx_dev *to_pd(struct device *dev)
{
	return container_of(dev, struct phx_dev, dev);
}

static ssize_t vendor_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%s\n", to_pd(dev)->ops->name);
}
static DEVICE_ATTR_RO(vendor);

static ssize_t ordinal_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%d\n", to_pd(dev)->ordinal);
}
static DEVICE_ATTR_RO(ordinal);

static ssize_t page_size_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%lu\n", to_pd(dev)->ops->page_size);
}
static DEVICE_ATTR_RO(page_size);

/* "full": the whole BAR is ZONE_DEVICE pages and I/O lands in the user's buffer. */
static ssize_t map_mode_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "full\n");
}
static DEVICE_ATTR_RO(map_mode);

static ssize_t pci_bdf_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%s\n", pci_name(to_pd(dev)->pdev));
}
static DEVICE_ATTR_RO(pci_bdf);

static ssize_t bar_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%d\n", to_pd(dev)->bar);
}
static DEVICE_ATTR_RO(bar);

static ssize_t bar_size_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%llu\n", (u64)to_pd(dev)->bar_size);
}
static DEVICE_ATTR_RO(bar_size);

static ssize_t max_map_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%llu\n", min_t(u64, to_pd(dev)->bar_size, PHX_MAX_MAP_BYTES));
}
static DEVICE_ATTR_RO(max_map);

static ssize_t mappings_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%d\n", atomic_read(&to_pd(dev)->nmaps));
}
static DEVICE_ATTR_RO(mappings);

static ssize_t pinned_bytes_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(&to_pd(dev)->pinned_bytes));
}
static DEVICE_ATTR_RO(pinned_bytes);

static ssize_t reclaims_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(&to_pd(dev)->reclaims));
}
static DEVICE_ATTR_RO(reclaims);

/* Faults on the user mappings (each maps up to a 2 MiB block): a performance hint. */
static ssize_t faults_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(&to_pd(dev)->faults));
}
static DEVICE_ATTR_RO(faults);

static ssize_t abi_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%d\n", PHX_IOCTL_ABI);
}
static DEVICE_ATTR_RO(abi);

static struct attribute *phx_dev_attrs[] = {
	&dev_attr_vendor.attr,
	&dev_attr_ordinal.attr,
	&dev_attr_page_size.attr,
	&dev_attr_map_mode.attr,
	&dev_attr_pci_bdf.attr,
	&dev_attr_bar.attr,
	&dev_attr_bar_size.attr,
	&dev_attr_max_map.attr,
	&dev_attr_mappings.attr,
	&dev_attr_pinned_bytes.attr,
	&dev_attr_reclaims.attr,
	&dev_attr_faults.attr,
	&dev_attr_abi.attr,
	NULL,
};
ATTRIBUTE_GROUPS(phx_dev);

/* GENERIC pages idle at a reference count of 1 and never reach 0: nothing to free. */
static void phx_page_free(struct page *page)
{
}

static const struct dev_pagemap_ops phx_pgmap_ops = {
	.page_free = phx_page_free,
};

static void phx_dev_release(struct device *dev)
{
	kfree(to_pd(dev));
}

static struct phx_dev *phx_dev_find_pci(struct pci_dev *pdev)
{
	struct phx_backend *be;
	int i;

	list_for_each_entry(be, &phx_backends, node)
		for (i = 0; i < be->ndevs; i++)
			if (be->devs[i]->pdev == pdev)
				return be->devs[i];
	return NULL;
}

static int phx_dev_create(struct phx_backend *be, int ordinal, struct pci_dev *pdev,
			  struct phx_dev **out, const char **why)
{
	struct phx_dev *pd;
	resource_size_t best = 0;
	void *va;
	int bar = -1, i, minor, err;

	if (phx_dev_find_pci(pdev)) {
		*why = "already served by another backend";
		return -EBUSY;
	}
	for (i = 0; i < PCI_STD_NUM_BARS; i++) {
		if ((pci_resource_flags(pdev, i) & IORESOURCE_MEM) &&
		    pci_resource_len(pdev, i) > best) {
			best = pci_resource_len(pdev, i);
			bar = i;
		}
	}
	if (bar < 0) {
		*why = "no memory BAR";
		return -ENODEV;
	}
	/* memory hotplug adds memory in subsections (2 MiB): a BAR is naturally aligned */
	if (!IS_ALIGNED(pci_resource_start(pdev, bar), SUBSECTION_SIZE) ||
	    !IS_ALIGNED(best, SUBSECTION_SIZE)) {
		*why = "largest BAR is not 2 MiB aligned";
		return -EINVAL;
	}

	pd = kzalloc(sizeof(*pd), GFP_KERNEL);
	if (!pd)
		return -ENOMEM;
	pd->be = be;
	pd->ops = be->ops;
	pd->ordinal = ordinal;
	pd->pdev = pdev;
	pd->bar = bar;
	pd->bar_phys = pci_resource_start(pdev, bar);
	pd->bar_bus = pci_bus_address(pdev, bar);
	pd->bar_size = best;
	mutex_init(&pd->lock);
	INIT_LIST_HEAD(&pd->files);
	spin_lock_init(&pd->zlock);
	INIT_LIST_HEAD(&pd->zombies);
	INIT_DELAYED_WORK(&pd->reaper, phx_reap);

	/*
	 * Device memory behind a BAR is not coherent with CPU caches (a disk's P2P write
	 * does not snoop them), and the vendor driver maps it write-combining: reserve WC
	 * first, so the direct map memremap_pages makes (and our user mappings) are WC
	 * too rather than write-back.
	 */
	err = arch_io_reserve_memtype_wc(pd->bar_phys, best);
	if (err) {
		kfree(pd);
		*why = "cannot reserve the BAR write-combining (PAT)";
		return err;
	}
	pd->pgmap.type = MEMORY_DEVICE_GENERIC;
	pd->pgmap.range.start = pd->bar_phys;
	pd->pgmap.range.end = pd->bar_phys + best - 1;
	pd->pgmap.nr_range = 1;
	pd->pgmap.ops = &phx_pgmap_ops;
	va = memremap_pages(&pd->pgmap, dev_to_node(&pdev->dev));
	if (IS_ERR(va)) {
		err = PTR_ERR(va);
		arch_io_free_memtype_wc(pd->bar_phys, best);
		kfree(pd);
		*why = "memremap_pages of the BAR failed";
		return err;
	}

	minor = ida_alloc_max(&phx_minors, PHX_MAX_MINORS - 1, GFP_KERNEL);
	if (minor < 0) {
		memunmap_pages(&pd->pgmap);
		arch_io_free_memtype_wc(pd->bar_phys, best);
		kfree(pd);
		*why = "no free minor number";
		return minor;
	}
	device_initialize(&pd->dev);
	pd->dev.class = phx_class;
	pd->dev.parent = &pdev->dev;
	pd->dev.devt = MKDEV(MAJOR(phx_devt), minor);
	pd->dev.groups = phx_dev_groups;
	pd->dev.release = phx_dev_release;
	err = dev_set_name(&pd->dev, "phx_%s%d", be->ops->name, ordinal);
	if (!err) {
		cdev_init(&pd->cdev, &phx_fops);
		pd->cdev.owner = be->ops->owner;	/* an open file pins the backend */
		err = cdev_device_add(&pd->cdev, &pd->dev);
	}
	if (err) {
		memunmap_pages(&pd->pgmap);
		arch_io_free_memtype_wc(pd->bar_phys, best);
		ida_free(&phx_minors, minor);
		put_device(&pd->dev);
		*why = "cannot create the character device";
		return err;
	}
	dev_info(&pd->dev, "%s BAR %d (%llu MiB) of %s is ZONE_DEVICE memory (map_mode full)\n",
		 be->ops->name, bar, (u64)best >> 20, pci_name(pdev));
	*out = pd;
	return 0;
}

/* Wait until no page of the BAR is referenced beyond its idle count. */
static void phx_dev_wait_idle(struct phx_dev *pd)
{
	unsigned long pfn, first = PHYS_PFN(pd->bar_phys), end = first + PHYS_PFN(pd->bar_size);
	unsigned long busy, waited = 0;

	for (;;) {
		busy = 0;
		for (pfn = first; pfn < end; pfn++) {
			if (page_ref_count(pfn_to_page(pfn)) > 1)
				busy++;
			if (!(pfn & 0xffff))
				cond_resched();
		}
		if (!busy)
			return;
		if (!(waited % 100))
			pr_warn("%s: waiting for %lu pages still referenced (I/O in flight?)\n",
				dev_name(&pd->dev), busy);
		msleep(100);
		waited++;
	}
}

static void phx_dev_destroy(struct phx_dev *pd)
{
	struct phx_file *pf;
	bool zombies;
	int minor = MINOR(pd->dev.devt);

	cdev_device_del(&pd->cdev, &pd->dev);	/* no new opens */
	mutex_lock(&pd->lock);
	WRITE_ONCE(pd->dead, true);		/* ioctls on open files fail with ENODEV */
	list_for_each_entry(pf, &pd->files, node)
		phx_file_teardown(pf, PHX_UNMAP_WAIT_MS);
	mutex_unlock(&pd->lock);
	for (;;) {
		spin_lock(&pd->zlock);
		zombies = !list_empty(&pd->zombies);
		spin_unlock(&pd->zlock);
		if (!zombies)
			break;
		flush_delayed_work(&pd->reaper);
		msleep(PHX_REAP_MS);
	}
	cancel_delayed_work_sync(&pd->reaper);
	phx_dev_wait_idle(pd);
	memunmap_pages(&pd->pgmap);
	arch_io_free_memtype_wc(pd->bar_phys, pd->bar_size);
	ida_free(&phx_minors, minor);
	put_device(&pd->dev);
}

/* ---- backends -------------------------------------------------------------------- */

static bool phx_ops_valid(const struct phx_p2p_ops *ops)
{
	return ops && ops->abi_version == PHX_P2P_ABI_VERSION && ops->name && ops->name[0] &&
	       strlen(ops->name) < 16 && !strchr(ops->name, '/') &&
	       is_power_of_2(ops->page_size) && ops->page_size >= PAGE_SIZE &&
	       ops->get_pages && ops->put_pages && ops->get_n_pages && ops->get_phys_addrs &&
	       ops->free_page_table && ops->pci_device;
}

static struct phx_backend *phx_backend_find(const char *name)
{
	struct phx_backend *be;

	list_for_each_entry(be, &phx_backends, node)
		if (!strcmp(be->ops->name, name))
			return be;
	return NULL;
}

int phx_p2p_register(const struct phx_p2p_ops *ops)
{
	struct phx_backend *be;
	struct pci_dev *pdev;
	const char *why;
	int ordinal, err;

	if (!phx_ops_valid(ops)) {
		pr_err("backend %s: invalid operations table (ABI %u, core has %u)\n",
		       ops && ops->name ? ops->name : "?", ops ? ops->abi_version : 0,
		       PHX_P2P_ABI_VERSION);
		return -EINVAL;
	}
	be = kzalloc(sizeof(*be), GFP_KERNEL);
	if (!be)
		return -ENOMEM;
	be->ops = ops;

	mutex_lock(&phx_lock);
	if (phx_backend_find(ops->name)) {
		mutex_unlock(&phx_lock);
		kfree(be);
		pr_err("backend %s is already registered\n", ops->name);
		return -EEXIST;
	}
	why = NULL;
	err = ops->init ? ops->init(&why) : 0;
	if (err) {
		be->status = err;
		be->why = why ? why : "its init failed";
		pr_info("backend %s loaded, cannot serve: %s (%d)\n", ops->name, be->why, err);
		list_add_tail(&be->node, &phx_backends);
		mutex_unlock(&phx_lock);
		return 0;
	}
	for (ordinal = 0; ordinal < PHX_MAX_DEVS; ordinal++) {
		struct phx_dev *pd;

		pdev = ops->pci_device(ordinal);
		if (!pdev)
			break;
		why = "?";
		err = phx_dev_create(be, ordinal, pdev, &pd, &why);
		if (err) {
			pr_warn("backend %s: device %d (%s) not attached: %s (%d)\n", ops->name,
				ordinal, pci_name(pdev), why, err);
			scnprintf(be->note, sizeof(be->note), "device %d (%s) not attached: %s (%d)",
				  ordinal, pci_name(pdev), why, err);
			continue;
		}
		be->devs[be->ndevs++] = pd;
	}
	list_add_tail(&be->node, &phx_backends);
	mutex_unlock(&phx_lock);
	pr_info("backend %s registered: %d device(s), page size %lu\n", ops->name, be->ndevs,
		ops->page_size);
	return 0;
}
EXPORT_SYMBOL_GPL(phx_p2p_register);

void phx_p2p_unregister(const struct phx_p2p_ops *ops)
{
	struct phx_backend *be;
	int i;

	mutex_lock(&phx_lock);
	list_for_each_entry(be, &phx_backends, node)
		if (be->ops == ops)
			goto found;
	mutex_unlock(&phx_lock);
	pr_err("backend %s was not registered\n", ops && ops->name ? ops->name : "?");
	return;
found:
	list_del(&be->node);
	for (i = 0; i < be->ndevs; i++)
		phx_dev_destroy(be->devs[i]);
	if (!be->status && ops->exit)
		ops->exit();
	mutex_unlock(&phx_lock);
	pr_info("backend %s unregistered\n", ops->name);
	kfree(be);
}
EXPORT_SYMBOL_GPL(phx_p2p_unregister);

/* /sys/class/phx/backends: one line per backend, "<name> <available|unavailable>
 * devices=<n> page_size=<bytes>[ reason: <why>]". */
static ssize_t backends_show(PHX_CLASS_CONST struct class *cls,
			     PHX_CLASS_CONST struct class_attribute *attr, char *buf)
{
	struct phx_backend *be;
	int n = 0;

	mutex_lock(&phx_lock);
	list_for_each_entry(be, &phx_backends, node) {
		n += sysfs_emit_at(buf, n, "%s %s devices=%d page_size=%lu", be->ops->name,
				   be->status ? "unavailable" : "available", be->ndevs,
				   be->ops->page_size);
		if (be->status)
			n += sysfs_emit_at(buf, n, " reason: %s (%d)", be->why, be->status);
		else if (be->note[0])
			n += sysfs_emit_at(buf, n, " reason: %s", be->note);
		n += sysfs_emit_at(buf, n, "\n");
	}
	mutex_unlock(&phx_lock);
	return n;
}

static ssize_t abi_class_show(PHX_CLASS_CONST struct class *cls,
			      PHX_CLASS_CONST struct class_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "ioctl=%d p2p=%d\n", PHX_IOCTL_ABI, PHX_P2P_ABI_VERSION);
}

static struct class_attribute phx_class_attrs[] = {
	__ATTR(backends, 0444, backends_show, NULL),
	__ATTR(abi, 0444, abi_class_show, NULL),
};

static int __init phx_init(void)
{
	int err, i;

	phx_wq = alloc_workqueue("phx", WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
	if (!phx_wq)
		return -ENOMEM;
	err = alloc_chrdev_region(&phx_devt, 0, PHX_MAX_MINORS, "phx");
	if (err)
		goto out_wq;
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 4, 0)
	phx_class = class_create("phx");
#else
	phx_class = class_create(THIS_MODULE, "phx");
#endif
	if (IS_ERR(phx_class)) {
		err = PTR_ERR(phx_class);
		goto out_chrdev;
	}
	for (i = 0; i < ARRAY_SIZE(phx_class_attrs); i++) {
		err = class_create_file(phx_class, &phx_class_attrs[i]);
		if (err)
			goto out_attrs;
	}
	pr_info("loaded: ioctl ABI %d, vendor ABI %d; waiting for vendor backends\n",
		PHX_IOCTL_ABI, PHX_P2P_ABI_VERSION);
	return 0;

out_attrs:
	while (--i >= 0)
		class_remove_file(phx_class, &phx_class_attrs[i]);
	class_destroy(phx_class);
out_chrdev:
	unregister_chrdev_region(phx_devt, PHX_MAX_MINORS);
out_wq:
	destroy_workqueue(phx_wq);
	return err;
}

static void __exit phx_exit(void)
{
	int i;

	/* Backends depend on our symbols, so none is registered any more. */
	for (i = 0; i < ARRAY_SIZE(phx_class_attrs); i++)
		class_remove_file(phx_class, &phx_class_attrs[i]);
	class_destroy(phx_class);
	unregister_chrdev_region(phx_devt, PHX_MAX_MINORS);
	destroy_workqueue(phx_wq);
	pr_info("unloaded\n");
}

module_init(phx_init);
module_exit(phx_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Phoenix direct path: device memory as ZONE_DEVICE pages for O_DIRECT I/O");
MODULE_AUTHOR("Phoenix for Python");
