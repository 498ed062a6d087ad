/* The vendor data-path table: raw C entry points the I/O core calls without the GIL.
 *
 * Core side, data path. Mirrors phoenix.vendor.DataPathTable (ctypes) field for
 * field; DATA_PATH_ABI there equals PHX_DP_ABI here. Signatures are the CUDA
 * runtime's, so a CUDA-shaped runtime (cuda*, mc*, hip*, ...) fills the table with
 * its own symbols. Every function returns the runtime's status; `success` is ok.
 */
#ifndef PHX_VENDOR_H
#define PHX_VENDOR_H

#include <stddef.h>
#include <stdint.h>

#define PHX_DP_ABI 3

typedef void (*phx_host_fn)(void *arg);

struct phx_dp_table {
    uint32_t abi_version;
    int success;
    int kind_h2h, kind_h2d, kind_d2h, kind_d2d; /* the runtime's copy-kind values */
    unsigned stream_flags;                      /* flags for stream_create (non-blocking) */
    unsigned host_register_flags;               /* flags for host_register */
    int (*set_device)(int ordinal);
    int (*memcpy_async)(void *dst, const void *src, size_t n, int kind, void *stream);
    int (*stream_create)(void **stream, unsigned flags);
    int (*stream_synchronize)(void *stream);
    int (*stream_destroy)(void *stream);
    int (*launch_host_func)(void *stream, phx_host_fn fn, void *arg);
    int (*host_register)(void *ptr, size_t n, unsigned flags);
    int (*host_unregister)(void *ptr);
    /* Events: ordering with the caller's stream (optional, all or none). An I/O call on
     * device memory records an event on the caller's stream; the worker streams wait for
     * it before their copies (stream_wait_event), and the direct path (the CPU or the disk
     * writes the memory) waits for it on the host (event_synchronize). Without them the
     * core synchronizes the caller's stream before submitting (phx info says so). */
    unsigned event_flags;                        /* flags for event_create (no timing) */
    /* The read-only bit of the runtime's host_register flags (0: it has none). A refused
     * registration of a file mapping (phx_io_config.fmap_register_flags) is retried
     * without it (CUDA-shaped runtimes: cudaHostRegisterReadOnly's value; the port says). */
    unsigned host_register_read_only;
    int (*get_device)(int *ordinal);
    int (*event_create)(void **event, unsigned flags);
    int (*event_record)(void *event, void *stream);
    int (*stream_wait_event)(void *stream, void *event, unsigned flags);
    int (*event_synchronize)(void *event);
    int (*event_destroy)(void *event);
    /* Completion by polling (optional, with the events above): event_query(ev) returns
     * `success` once the stream has passed the latest record and `not_ready` before.
     * With it, io_uring workers learn that their copies are done by recording an event
     * and querying it between I/Os, instead of launching a host callback (each costs the
     * runtime's callback thread tens of microseconds). */
    int not_ready;
    int (*event_query)(void *event);
};

/* All of the event entry points are there: the core orders I/O with events. */
static inline int phx_dp_has_events(const struct phx_dp_table *dp)
{
    return dp->get_device && dp->event_create && dp->event_record && dp->stream_wait_event &&
           dp->event_synchronize && dp->event_destroy;
}

/* ... and event_query: workers poll their copies' events (no host callbacks). */
static inline int phx_dp_can_poll(const struct phx_dp_table *dp)
{
    return phx_dp_has_events(dp) && dp->event_query;
}

#endif
