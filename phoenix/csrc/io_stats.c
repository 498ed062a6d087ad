/* The core's counters: one process-wide set, read by phx_io_get_stats.
 *
 * Core side: written on the data path (STAT_ADD: relaxed atomics), read on the control
 * plane (phoenix.io.stats, phx info, the leak checks of the tests).
 */
#include "io_common.h"

struct io_counters io_stats;

void phx_io_get_stats(struct phx_io_stats *o)
{
#define S(name) o->name = atomic_load(&io_stats.name);
    PHX_IO_STATS(S)
#undef S
}

const char *phx_io_stats_fields(void)
{
    /* the field names of struct phx_io_stats in order, comma-separated: the Python side
     * builds its mirror of the struct from this, so the list is written once (phx_io.h) */
#define S(name) #name ","
    static const char names[] = PHX_IO_STATS(S);
#undef S
    return names;
}
