/* Test hooks of the I/O core: not part of the API of phx_io.h.
 *
 * Core side, test plane. The core's library still exports what is declared here,
 * because only the core can reach into its own objects: this is the core's
 * fault-injection hook (tests reach it through Python's test hooks). Nothing on the data
 * path of an application calls it; a test double of a vendor runtime (the host
 * vendor's library) lives outside the core, with its own test hooks.
 */
#ifndef PHX_TESTING_H
#define PHX_TESTING_H

#include <stdint.h>

#include "phx_io.h"

/* Every transfer of this file overlapping [offset, offset+length) fails with err (err 0
 * clears); EINVAL hits only O_DIRECT transfers, as a file system that refuses O_DIRECT
 * at the first I/O does. Lets tests prove that a failed chunk fails only its request,
 * and exercise the buffered fallback. Also keeps the file out of the file-mapping cache
 * while set (a hit would bypass the fault). */
int phx_file_inject_fault(phx_file *f, int64_t offset, uint64_t length, int err);

/* Act as if the kernel had reported memory pressure: the registrar releases every window
 * of the context's file-mapping cache (those in use when their requests finish) and
 * registers none for a while. Returns 0, or -EINVAL. */
int phx_fmap_simulate_pressure(phx_ctx *ctx);

#endif
