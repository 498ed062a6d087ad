/* The host reference runtime (a TEST DOUBLE), vendor-runtime side: streams.
 *
 * Test side (a vendor runtime's test double, outside the C core), part of
 * libphxhostrt.so and of every emulator. This file: streams as FIFO worker threads
 * (a host function runs on the worker in stream order and never touches Python),
 * handles that are ids (a destroyed stream is recognised, not dereferenced), the
 * default stream (handles 0, 1 and 2), StreamCreate/Destroy/Synchronize/Query,
 * LaunchHostFunc and DeviceSynchronize, and what a forked child finds of them (its
 * workers gone: restarted with new work, the parent's queued work dropped). Locks:
 * g_streams_mu guards the registry, reference counts and default streams; each stream's
 * mu guards its queue.
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

/* -- streams ----------------------------------------------------------------------- */

struct stream {
    uint64_t id;    /* the handle; 0 for a device's default stream */
    int device;
    unsigned refs;  /* registry + callers inside the API (g_streams_mu) */
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    struct op *head, *tail; /* FIFO queue */
    struct op *spare;       /* recycled nodes: no malloc per op in steady state */
    int busy;               /* the worker is running an op */
    struct op *cur;         /* ... this one (a fork lets go of its pins) */
    int closing;            /* destroy began: refuse new work */
    int stop;               /* the worker exits once the queue is empty */
    int lost;               /* a fork dropped queued work: the next synchronize says so */
    pthread_t worker;
    uint64_t worker_gen;    /* the fork generation whose process runs `worker` */
};

pthread_mutex_t g_streams_mu = PTHREAD_MUTEX_INITIALIZER;
static struct stream **g_streams; /* live created streams, sorted by id (ids only grow) */
static size_t g_nstreams, g_capstreams;
static uint64_t g_next_stream_id = HANDLE_BASE;

static void *stream_worker(void *arg)
{
    struct stream *s = arg;
    pthread_setname_np(pthread_self(), "hostrt-stream"); /* not its creator's name (phx-io) */
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->work, &s->mu);
        struct op *o = s->head;
        if (!o)
            break; /* stop requested and the queue drained */
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        s->cur = o;
        pthread_mutex_unlock(&s->mu);

        if (o->fn)
            o->fn(o->arg);
        else
            memmove(o->dst, o->src, o->n);
        o->ran = 1;
        unpin(o->pins);

        pthread_mutex_lock(&s->mu);
        o->next = s->spare;
        s->spare = o;
        s->busy = 0;
        s->cur = NULL;
        if (!s->head)
            pthread_cond_broadcast(&s->idle);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void stream_free(struct stream *s)
{
    for (struct op *o = s->spare, *next; o; o = next) {
        next = o->next;
        free(o);
    }
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->idle);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* Start the stream's worker (a new stream, or the first work after a fork: the worker of
 * the parent is not the child's). 0, or an errno. */
static int stream_start_worker(struct stream *s)
{
    /* The worker blocks asynchronous signals: they belong to the application's threads.
     * Not the synchronous ones: a fault the worker itself raises (SIGBUS: a copy from a
     * file mapping whose file was truncated) must reach the process's handler (phoenix's
     * file-mapping fault guard, faulthandler); blocked, the kernel kills the process. */
    sigset_t all, old;
    sigfillset(&all);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGTRAP);
    sigdelset(&all, SIGSYS);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&s->worker, NULL, stream_worker, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!err)
        s->worker_gen = g_fork_gen;
    return err;
}

static int stream_has_worker(const struct stream *s) { return s->worker_gen == g_fork_gen; }

static struct stream *stream_new(int device)
{
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->device = device;
    s->refs = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->idle, NULL);
    if (stream_start_worker(s)) {
        stream_free(s);
        return NULL;
    }
    return s;
}

/* Index of the created stream with this id in the registry, or -1. g_streams_mu held. */
static ptrdiff_t registry_find(uint64_t id)
{
    size_t lo = 0, hi = g_nstreams;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_streams[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < g_nstreams && g_streams[lo]->id == id) ? (ptrdiff_t)lo : -1;
}

/* Resolve a handle to a stream and hold a reference; 0 (and its aliases 1 and 2) is the
 * current device's default stream (created at first use, never destroyed). Release with
 * stream_release. */
int stream_acquire(phxrtStream_t handle, struct stream **out)
{
    uint64_t id = (uintptr_t)handle;
    int rc = PHXRT_SUCCESS;
    pthread_mutex_lock(&g_streams_mu);
    if (id <= 2) {
        struct device *d = current_device(&rc);
        if (d && !d->default_stream && !(d->default_stream = stream_new(tls_device)))
            rc = PHXRT_ERR_MEMORY_ALLOCATION;
        *out = d ? d->default_stream : NULL;
    } else {
        ptrdiff_t i = registry_find(id);
        if (i >= 0) {
            *out = g_streams[i];
            (*out)->refs++;
        } else {
            rc = PHXRT_ERR_INVALID_RESOURCE_HANDLE; /* never created, or destroyed */
        }
    }
    pthread_mutex_unlock(&g_streams_mu);
    return rc;
}

void stream_release(struct stream *s)
{
    if (s->id == 0)
        return; /* default streams live as long as the process */
    pthread_mutex_lock(&g_streams_mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&g_streams_mu);
    if (last)
        stream_free(s);
}

void stream_wait_idle(struct stream *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy)
        pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Refuse new work, let queued work complete (as CUDA does), and join the worker. */
static void stream_stop(struct stream *s)
{
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    while (s->head || s->busy)
        pthread_cond_wait(&s->idle, &s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->work);
    int joined = stream_has_worker(s); /* (a parent's stream the child gave no work: none) */
    pthread_mutex_unlock(&s->mu);
    if (joined)
        pthread_join(s->worker, NULL);
}

/* The stream lost work to a fork since it was last asked (once). */
static int stream_take_lost(struct stream *s)
{
    pthread_mutex_lock(&s->mu);
    int lost = s->lost;
    s->lost = 0;
    pthread_mutex_unlock(&s->mu);
    return lost;
}

int stream_push(struct stream *s, const struct op *op)
{
    pthread_mutex_lock(&s->mu);
    if (s->closing) {
        pthread_mutex_unlock(&s->mu);
        return PHXRT_ERR_INVALID_RESOURCE_HANDLE;
    }
    if (!stream_has_worker(s) && stream_start_worker(s)) { /* a forked child's first work */
        pthread_mutex_unlock(&s->mu);
        return PHXRT_ERR_MEMORY_ALLOCATION;
    }
    struct op *o = s->spare;
    if (o) {
        s->spare = o->next;
    } else if (!(o = malloc(sizeof *o))) {
        pthread_mutex_unlock(&s->mu);
        return PHXRT_ERR_MEMORY_ALLOCATION;
    }
    *o = *op;
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    return PHXRT_SUCCESS;
}

int RT(StreamCreateWithFlags)(phxrtStream_t *stream, unsigned flags)
{
    ENSURE_INIT();
    int rc;
    if (!current_device(&rc))
        return report(rc);
    if (!stream || (flags & ~STREAM_NONBLOCKING))
        return report(PHXRT_ERR_INVALID_VALUE);
    struct stream *s = stream_new(tls_device);
    if (!s)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    pthread_mutex_lock(&g_streams_mu);
    if (g_nstreams == g_capstreams) {
        size_t cap = g_capstreams ? 2 * g_capstreams : 16;
        struct stream **grown = realloc(g_streams, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g_streams_mu);
            stream_stop(s);
            stream_free(s);
            return report(PHXRT_ERR_MEMORY_ALLOCATION);
        }
        g_streams = grown;
        g_capstreams = cap;
    }
    s->id = g_next_stream_id++; /* handles are ids, never reused: a stale one is detected */
    g_streams[g_nstreams++] = s;
    pthread_mutex_unlock(&g_streams_mu);
    *stream = (phxrtStream_t)(uintptr_t)s->id;
    return PHXRT_SUCCESS;
}

int RT(StreamDestroy)(phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s = NULL;
    pthread_mutex_lock(&g_streams_mu);
    ptrdiff_t i = stream ? registry_find((uintptr_t)stream) : -1;
    if (i >= 0) { /* unlink: later lookups fail; this call now owns the registry's reference */
        s = g_streams[i];
        memmove(&g_streams[i], &g_streams[i + 1], (g_nstreams - (size_t)i - 1) * sizeof *g_streams);
        g_nstreams--;
    }
    pthread_mutex_unlock(&g_streams_mu);
    if (!s)
        return report(PHXRT_ERR_INVALID_RESOURCE_HANDLE);
    stream_stop(s);
    stream_release(s);
    return PHXRT_SUCCESS;
}

int RT(StreamSynchronize)(phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    stream_wait_idle(s);
    int lost = stream_take_lost(s);
    stream_release(s);
    return lost ? report(PHXRT_ERR_LAUNCH_FAILURE) : PHXRT_SUCCESS;
}

int RT(StreamQuery)(phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    pthread_mutex_lock(&s->mu);
    int idle = !s->head && !s->busy, lost = idle && s->lost;
    if (lost)
        s->lost = 0;
    pthread_mutex_unlock(&s->mu);
    stream_release(s);
    if (lost)
        return report(PHXRT_ERR_LAUNCH_FAILURE);
    return idle ? PHXRT_SUCCESS : PHXRT_ERR_NOT_READY; /* not an error: not recorded */
}

int RT(LaunchHostFunc)(phxrtStream_t stream, phxrtHostFn_t fn, void *arg)
{
    ENSURE_INIT();
    if (!fn)
        return report(PHXRT_ERR_INVALID_VALUE);
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    rc = stream_push(s, &(struct op){.fn = fn, .arg = arg});
    stream_release(s);
    return report(rc);
}
int RT(DeviceSynchronize)(void)
{
    ENSURE_INIT();
    int rc;
    struct device *d = current_device(&rc);
    if (!d)
        return report(rc);
    /* Hold a reference to each stream of the device, then wait for each outside the lock. */
    pthread_mutex_lock(&g_streams_mu);
    struct stream **held = malloc((g_nstreams + 1) * sizeof *held);
    size_t n = 0;
    if (held) {
        if (d->default_stream)
            held[n++] = d->default_stream;
        for (size_t i = 0; i < g_nstreams; i++)
            if (g_streams[i]->device == tls_device) {
                g_streams[i]->refs++;
                held[n++] = g_streams[i];
            }
    }
    pthread_mutex_unlock(&g_streams_mu);
    if (!held)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    int lost = 0;
    for (size_t i = 0; i < n; i++) {
        stream_wait_idle(held[i]);
        lost |= stream_take_lost(held[i]);
        stream_release(held[i]);
    }
    free(held);
    return lost ? report(PHXRT_ERR_LAUNCH_FAILURE) : PHXRT_SUCCESS;
}

/* -- fork ---------------------------------------------------------------------------- */

/* Every stream a call can still reach: the registry's and the devices' default streams.
 * (A stream unlinked by a StreamDestroy in progress is reachable by no call.) */
static void streams_each(void (*fn)(struct stream *))
{
    for (size_t i = 0; i < g_nstreams; i++)
        fn(g_streams[i]);
    for (int d = 0; d < g.ndev; d++)
        if (g.dev[d].default_stream)
            fn(g.dev[d].default_stream);
}

static void stream_lock(struct stream *s) { pthread_mutex_lock(&s->mu); }
static void stream_unlock(struct stream *s) { pthread_mutex_unlock(&s->mu); }

/* The child: its worker is gone (started again by the stream's next work), so is what it
 * ran and what waited in its queue. Their pins go (a Free must not wait for copies that
 * never run); the nodes are kept as spares; the stream remembers it lost work. */
static void stream_child(struct stream *s)
{
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->idle, NULL);
    if (s->busy && s->cur) { /* (its pins are still there if its copy had not finished) */
        unpin(s->cur->pins);
        s->lost |= !s->cur->ran;
        s->cur->next = s->spare;
        s->spare = s->cur;
    }
    s->busy = 0;
    s->cur = NULL;
    for (struct op *o = s->head, *next; o; o = next) {
        next = o->next;
        unpin(o->pins);
        o->next = s->spare;
        s->spare = o;
        s->lost = 1;
    }
    s->head = s->tail = NULL;
}

void streams_fork(int phase)
{
    if (phase == FORK_PREPARE) {
        pthread_mutex_lock(&g_streams_mu);
        streams_each(stream_lock);
    } else if (phase == FORK_PARENT) {
        streams_each(stream_unlock);
        pthread_mutex_unlock(&g_streams_mu);
    } else {
        pthread_mutex_init(&g_streams_mu, NULL);
        streams_each(stream_child); /* (after mem_fork: unpin takes g_mem) */
    }
}
