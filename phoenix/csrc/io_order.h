/* Ordering with the caller's stream (io_order.c; phx_io.h states the rule).
 *
 * Core side, data path: fences are recorded in the caller's thread, waited for by
 * submitters (host waits) and workers (their streams wait), released anywhere.
 */
#ifndef PHX_IO_ORDER_H
#define PHX_IO_ORDER_H

#include "io_common.h"

struct phx_ctx;
struct io_worker;
struct phx_fence {
    struct phx_ctx *ctx;
    void *event;               /* the vendor's event, created on `device` */
    int device;
    uint64_t id;               /* unique per record: what a worker stream waited for last */
    _Atomic int refs;          /* the caller's, and one per request naming it */
    _Atomic int passed;        /* the host saw the caller's stream pass it (event_synchronize) */
    struct phx_fence *next;    /* the context's free list */
};

#pragma GCC visibility push(hidden)
/* A request's memory is touched by the CPU or the disk: wait on the host (caller's thread). */
int fence_host_wait(phx_fence *f);
/* Before a device copy on the worker's `stream` for device `dev`: make the stream wait for
 * the fence (once per fence and stream). 1 when the stream now waits for it (the copy's
 * time includes that wait), 0 when nothing was to wait for (or it was waited for here),
 * -EIO when the vendor refused both ways. */
int fence_order_copy(struct io_worker *w, int dev, void *stream, phx_fence *f);
phx_fence *fence_ref(phx_fence *f);
void fence_fini(struct phx_ctx *ctx);
/* Queue on `device`'s streams: the default stream (0, and the legacy default's aliases) is the
 * current device's. Makes `device` current where another is; *prev is then the caller's, to
 * give back with device_restore (-1: nothing switched: `device` < 0, already current, or a
 * runtime without get_device). -EIO where set_device refuses. */
struct phx_dp_table;
int device_switch(const struct phx_dp_table *dp, int device, int *prev);
void device_restore(const struct phx_dp_table *dp, int prev);
#pragma GCC visibility pop

#endif
