/* A minimal io_uring ring through the raw system calls (io_ring.c).
 *
 * Core side, data path: one ring per io_uring worker, used only by that thread.
 */
#ifndef PHX_IO_RING_H
#define PHX_IO_RING_H

#include <linux/io_uring.h>
#include <stddef.h>

#include "io_common.h"

struct io_ring {
    int fd;
    unsigned sq_entries, cq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *sq_flags;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_size, cq_map_size, sqes_size;
    unsigned sqe_tail;   /* local tail: SQEs handed out, not yet published */
    unsigned to_submit;  /* published, not yet consumed by io_uring_enter */
    unsigned setup_flags;
    unsigned features;   /* IORING_FEAT_* of the kernel */
};

#pragma GCC visibility push(hidden)
int ring_init(struct io_ring *r, unsigned entries, char *why, size_t why_len);
void ring_exit(struct io_ring *r);
struct io_uring_sqe *ring_get_sqe(struct io_ring *r);
/* Publish the SQEs handed out, submit them, and wait for wait_nr completions. */
int ring_enter(struct io_ring *r, unsigned wait_nr);
/* The same, the wait bounded by ns (-ETIME when it passed with no completion). Needs
 * IORING_FEAT_EXT_ARG (5.11+): ring_can_time_wait. */
int ring_enter_timeout(struct io_ring *r, unsigned wait_nr, int64_t ns);
int ring_can_time_wait(const struct io_ring *r);
struct io_uring_cqe *ring_peek_cqe(struct io_ring *r);
void ring_cqe_seen(struct io_ring *r);
/* Registered buffers: a sparse table of n slots; put one buffer in slot idx (0 / -errno). */
int ring_buffers_sparse(struct io_ring *r, unsigned n);
int ring_buffer_set(struct io_ring *r, unsigned idx, void *base, size_t len);
/* Does the kernel take io_uring here (and IORING_OP_READ/WRITE)? */
int ring_probe(char *why, size_t why_len);
#pragma GCC visibility pop

#endif
