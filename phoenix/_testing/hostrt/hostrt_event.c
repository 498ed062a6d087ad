/* The host reference runtime (a TEST DOUBLE), vendor-runtime side: events.
 *
 * Test side (a vendor runtime's test double, outside the C core), part of
 * libphxhostrt.so and of every emulator. This file: EventCreate/Record/Query/
 * Synchronize/Destroy and StreamWaitEvent, as marker and wait ops queued on streams
 * (hostrt_stream.c); how below.
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

/* -- events ---------------------------------------------------------------------------
 *
 * An event is an id (like a stream handle, so a destroyed one is recognised) naming its
 * latest record: Record queues a marker op on the stream that marks that record done
 * when the worker reaches it. Query, Synchronize and StreamWaitEvent look at the latest
 * record at the time of the call, as CUDA's do (a later Record does not change what an
 * earlier wait waits for; an event never recorded is complete). StreamWaitEvent queues
 * an op that holds the waiting stream until the record is done. Queued markers and waits
 * hold references, so Destroy with work in flight is safe (CUDA allows it). Locks:
 * g_events_mu guards the registry and the events' reference counts, each event's mu its
 * records (and their reference counts); never nested (but by fork's prepare).
 *
 * fork: a record made before the fork and not done at it is lost (its marker was queued
 * on a stream whose work the child drops): Query, Synchronize and StreamWaitEvent say
 * LAUNCH_FAILURE for it, at once. */

struct event_record {
    unsigned refs; /* the event while it is the latest, the queued marker, waiters (ev->mu) */
    int done;
    uint64_t gen;  /* the fork generation it was recorded in */
};

/* Recorded before a fork and not done at it: nothing runs its marker here (ev->mu held). */
static int record_lost(const struct event_record *r) { return !r->done && r->gen != g_fork_gen; }

struct event {
    uint64_t id;
    unsigned refs;
    pthread_mutex_t mu;
    pthread_cond_t done;
    struct event_record *last; /* the latest record (NULL: never recorded) */
};

/* A queued marker or wait: the event (one reference) and the record it is about. */
struct event_op {
    struct event *ev;
    struct event_record *rec;
};

static pthread_mutex_t g_events_mu = PTHREAD_MUTEX_INITIALIZER;
static struct event **g_events; /* live events, sorted by id (ids only grow) */
static size_t g_nevents, g_capevents;
static uint64_t g_next_event_id = HANDLE_BASE;

static ptrdiff_t event_find(uint64_t id) /* g_events_mu held */
{
    size_t lo = 0, hi = g_nevents;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_events[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < g_nevents && g_events[lo]->id == id) ? (ptrdiff_t)lo : -1;
}

static int event_acquire(phxrtEvent_t handle, struct event **out)
{
    pthread_mutex_lock(&g_events_mu);
    ptrdiff_t i = handle ? event_find((uintptr_t)handle) : -1;
    if (i >= 0) {
        *out = g_events[i];
        (*out)->refs++;
    }
    pthread_mutex_unlock(&g_events_mu);
    return i >= 0 ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_RESOURCE_HANDLE;
}

static void record_unref(struct event_record *r) /* the event's mu held (or its last reference) */
{
    if (r && --r->refs == 0)
        free(r);
}

static void event_release(struct event *ev)
{
    pthread_mutex_lock(&g_events_mu);
    int last = --ev->refs == 0;
    pthread_mutex_unlock(&g_events_mu);
    if (last) {
        record_unref(ev->last);
        pthread_cond_destroy(&ev->done);
        pthread_mutex_destroy(&ev->mu);
        free(ev);
    }
}

/* The marker op: runs on the stream's worker once all earlier work on it finished. */
static void event_fire(void *arg)
{
    struct event_op *op = arg;
    struct event *ev = op->ev;
    pthread_mutex_lock(&ev->mu);
    op->rec->done = 1;
    record_unref(op->rec);
    pthread_cond_broadcast(&ev->done);
    pthread_mutex_unlock(&ev->mu);
    free(op);
    event_release(ev);
}

/* The wait op: holds the waiting stream until the record it was queued for is done. */
static void event_wait_op(void *arg)
{
    struct event_op *op = arg;
    struct event *ev = op->ev;
    pthread_mutex_lock(&ev->mu);
    while (!op->rec->done && !record_lost(op->rec))
        pthread_cond_wait(&ev->done, &ev->mu);
    record_unref(op->rec);
    pthread_mutex_unlock(&ev->mu);
    free(op);
    event_release(ev);
}

/* The latest record of ev with a reference for the caller, or NULL (never recorded). */
static struct event_record *event_latest(struct event *ev)
{
    pthread_mutex_lock(&ev->mu);
    struct event_record *r = ev->last;
    if (r)
        r->refs++;
    pthread_mutex_unlock(&ev->mu);
    return r;
}

int RT(EventCreateWithFlags)(phxrtEvent_t *event, unsigned flags)
{
    ENSURE_INIT();
    if (!event || (flags & ~0xFu)) /* CUDA's: blocking sync, disable timing, interprocess, ... */
        return report(PHXRT_ERR_INVALID_VALUE);
    struct event *ev = calloc(1, sizeof *ev);
    if (!ev)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    ev->refs = 1;
    pthread_mutex_init(&ev->mu, NULL);
    pthread_cond_init(&ev->done, NULL);
    pthread_mutex_lock(&g_events_mu);
    if (g_nevents == g_capevents) {
        size_t cap = g_capevents ? 2 * g_capevents : 16;
        struct event **grown = realloc(g_events, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g_events_mu);
            event_release(ev);
            return report(PHXRT_ERR_MEMORY_ALLOCATION);
        }
        g_events = grown;
        g_capevents = cap;
    }
    ev->id = g_next_event_id++;
    g_events[g_nevents++] = ev;
    pthread_mutex_unlock(&g_events_mu);
    *event = (phxrtEvent_t)(uintptr_t)ev->id;
    return PHXRT_SUCCESS;
}

int RT(EventCreate)(phxrtEvent_t *event)
{
    return RT(EventCreateWithFlags)(event, 0);
}

int RT(EventRecord)(phxrtEvent_t event, phxrtStream_t stream)
{
    ENSURE_INIT();
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    struct stream *s;
    if ((rc = stream_acquire(stream, &s)) != PHXRT_SUCCESS) {
        event_release(ev);
        return report(rc);
    }
    struct event_op *op = malloc(sizeof *op);
    struct event_record *r = calloc(1, sizeof *r);
    if (!op || !r) {
        free(op);
        free(r);
        stream_release(s);
        event_release(ev);
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    }
    r->refs = 2; /* the event (as its latest record) and the marker */
    r->gen = g_fork_gen;
    op->ev = ev; /* the reference taken above now belongs to the marker */
    op->rec = r;
    pthread_mutex_lock(&ev->mu);
    record_unref(ev->last);
    ev->last = r;
    pthread_mutex_unlock(&ev->mu);
    rc = stream_push(s, &(struct op){.fn = event_fire, .arg = op});
    stream_release(s);
    if (rc != PHXRT_SUCCESS) { /* never queued: complete it here, so waiters do not hang */
        event_fire(op);
        return report(rc);
    }
    return PHXRT_SUCCESS;
}

int RT(StreamWaitEvent)(phxrtStream_t stream, phxrtEvent_t event, unsigned flags)
{
    ENSURE_INIT();
    if (flags)
        return report(PHXRT_ERR_INVALID_VALUE); /* CUDA's only flag waits on external events */
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    struct stream *s;
    if ((rc = stream_acquire(stream, &s)) != PHXRT_SUCCESS) {
        event_release(ev);
        return report(rc);
    }
    struct event_record *r = event_latest(ev);
    if (!r) { /* never recorded: nothing to wait for */
        stream_release(s);
        event_release(ev);
        return PHXRT_SUCCESS;
    }
    pthread_mutex_lock(&ev->mu);
    int lost = record_lost(r);
    if (lost)
        record_unref(r);
    pthread_mutex_unlock(&ev->mu);
    if (lost) { /* a wait for it would hold the stream for good */
        stream_release(s);
        event_release(ev);
        return report(PHXRT_ERR_LAUNCH_FAILURE);
    }
    struct event_op *op = malloc(sizeof *op);
    if (!op) {
        pthread_mutex_lock(&ev->mu);
        record_unref(r);
        pthread_mutex_unlock(&ev->mu);
        stream_release(s);
        event_release(ev);
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    }
    op->ev = ev; /* the references taken above now belong to the wait op */
    op->rec = r;
    rc = stream_push(s, &(struct op){.fn = event_wait_op, .arg = op});
    stream_release(s);
    if (rc != PHXRT_SUCCESS) {
        pthread_mutex_lock(&ev->mu);
        record_unref(r);
        pthread_mutex_unlock(&ev->mu);
        free(op);
        event_release(ev);
        return report(rc);
    }
    return PHXRT_SUCCESS;
}

int RT(EventQuery)(phxrtEvent_t event)
{
    ENSURE_INIT();
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    pthread_mutex_lock(&ev->mu);
    int done = !ev->last || ev->last->done, lost = ev->last && record_lost(ev->last);
    pthread_mutex_unlock(&ev->mu);
    event_release(ev);
    if (lost)
        return report(PHXRT_ERR_LAUNCH_FAILURE);
    return done ? PHXRT_SUCCESS : PHXRT_ERR_NOT_READY; /* not an error: not recorded */
}

int RT(EventSynchronize)(phxrtEvent_t event)
{
    ENSURE_INIT();
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    pthread_mutex_lock(&ev->mu);
    struct event_record *r = ev->last; /* the latest record before this call */
    int lost = 0;
    if (r) {
        r->refs++;
        while (!r->done && !(lost = record_lost(r)))
            pthread_cond_wait(&ev->done, &ev->mu);
        record_unref(r);
    }
    pthread_mutex_unlock(&ev->mu);
    event_release(ev);
    return lost ? report(PHXRT_ERR_LAUNCH_FAILURE) : PHXRT_SUCCESS;
}

int RT(EventDestroy)(phxrtEvent_t event)
{
    ENSURE_INIT();
    struct event *ev = NULL;
    pthread_mutex_lock(&g_events_mu);
    ptrdiff_t i = event ? event_find((uintptr_t)event) : -1;
    if (i >= 0) { /* unlink; queued markers and waits keep their references */
        ev = g_events[i];
        memmove(&g_events[i], &g_events[i + 1], (g_nevents - (size_t)i - 1) * sizeof *g_events);
        g_nevents--;
    }
    pthread_mutex_unlock(&g_events_mu);
    if (!ev)
        return report(PHXRT_ERR_INVALID_RESOURCE_HANDLE);
    event_release(ev);
    return PHXRT_SUCCESS;
}

/* -- fork ---------------------------------------------------------------------------- */

void events_fork(int phase)
{
    if (phase == FORK_PREPARE) {
        pthread_mutex_lock(&g_events_mu);
        for (size_t i = 0; i < g_nevents; i++)
            pthread_mutex_lock(&g_events[i]->mu);
    } else if (phase == FORK_PARENT) {
        for (size_t i = 0; i < g_nevents; i++)
            pthread_mutex_unlock(&g_events[i]->mu);
        pthread_mutex_unlock(&g_events_mu);
    } else { /* their records stay: those not done are lost (record_lost) */
        pthread_mutex_init(&g_events_mu, NULL);
        for (size_t i = 0; i < g_nevents; i++) {
            pthread_mutex_init(&g_events[i]->mu, NULL);
            pthread_cond_init(&g_events[i]->done, NULL);
        }
    }
}
