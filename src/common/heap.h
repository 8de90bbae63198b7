// Giving freed heap memory back to the kernel between syncs.
//
// A sync allocates and frees a lot (staging scratch, manifests, protobufs, gRPC buffers) on many
// threads, and glibc keeps freed memory in its per-thread arenas: over a long job the resident
// size of a process then creeps up although its heap in use does not (measured by tools/soak.sh
// and heaptrack: the reference engine's heap stayed at 0.7 MB while its RSS grew by 2 MB over 200
// syncs). The long-lived processes call RequestHeapTrim once per sync (after the commit, after the
// trainer side's part); a background thread then runs malloc_trim, off the request path, which
// returns the arenas' free pages (what stays is the arenas' fragmentation: a few hundred KiB to
// 2 MiB on the soak's small processes, see docs/sync.md, "Soak").
// Thread-safety: any thread; requests made while a trim runs fold into one more trim. A no-op
// where the C library has no malloc_trim.
#pragma once

namespace wsync {

void RequestHeapTrim();

}  // namespace wsync
