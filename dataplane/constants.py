"""The dataplane's constants, each with where it matters (the Connect stream's are in
luftpause/link.py, the run book's in luftpause/runbook.py)."""

# Connecting to an engine gives up after this long: a silent host answers 502.
ENGINE_CONNECT_TIMEOUT_S = 2.0
# Idle pooled connections to engines are closed after this long: below the 5 s after
# which llama-server and uvicorn (vLLM, SGLang) close them, so a pooled connection is
# rarely one the engine has already closed.
ENGINE_KEEPALIVE_S = 4.0
# When it is, the request is sent again on a new connection (before any byte reached
# the client); at most this many times, as several pooled connections may be stale.
STALE_CONNECTION_RETRIES = 2
# A turn whose engine could not be reached, or died before any byte reached the client,
# is admitted again (its run idle, so it may move to another replica): at most this many
# attempts in all, the first retry after ENGINE_RETRY_DELAY_S (doubling), none started
# later than ENGINE_RETRY_WINDOW_S after the first failure (a turn re-sent after its
# replica stalled goes at once, having waited out a whole first-byte bound, and waits
# for admission like a new turn: the scheduler already took that replica out of
# rotation). Longer outages are the client's to retry (the runtime does,
# marked by the ENGINE_FAILURE header on the 502).
ENGINE_RETRY_ATTEMPTS = 3
ENGINE_RETRY_DELAY_S = 0.1
ENGINE_RETRY_WINDOW_S = 1.0
# A request whose engine stalled on it or dropped it after it arrived may be a query of
# death (dataplane/suspects.py): it is sent at most once more, and one that did so on
# SUSPECT_REPLICAS replicas is refused at once for SUSPECT_MEMORY_S (long enough to
# outlast a client's retries and a replica's restart; the same request after that is
# sent again). At most SUSPECT_MEMORY_ENTRIES such requests are remembered (16-byte
# fingerprints: well under a megabyte).
SUSPECT_REPLICAS = 2
SUSPECT_MEMORY_S = 600.0
SUSPECT_MEMORY_ENTRIES = 4096
# How long a turn waits for its engine's first byte, and in any pause of its stream
# (dataplane/timing.py): FIRST_BYTE_MARGIN times the slowest seconds per pending token
# of the replica's last FIRST_BYTE_HISTORY first bytes (its peers' while it has none;
# FIRST_BYTE_COLD_S_PER_TOKEN with none anywhere, as slow as a CPU engine's prefill),
# over the turn's own prompt, the prompts waiting there ahead of it and
# FIRST_BYTE_OVERHEAD_TOKENS; never below FIRST_BYTE_MIN_S nor below its prompt at
# FIRST_BYTE_FLOOR_S_PER_TOKEN (2000 tokens/s: a prompt whose prefix was cached may
# arrive uncached). A turn past it is re-sent elsewhere if no byte reached the client,
# and the replica is reported stalled (the scheduler takes it out of rotation).
FIRST_BYTE_MARGIN = 4.0
FIRST_BYTE_MIN_S = 2.0
FIRST_BYTE_HISTORY = 32
# A replica's own rates for a turn's kind (stream or whole reply) set its bound alone once
# there are this many; before, its other kind's slowest rate counts too where it is slower
# (dataplane/timing.py, FirstByteBounds._rate). One quick first byte may be a cached
# prefix (on a CPU engine 0.2 s, where the same prompt uncached takes 3 s): alone it made
# every later turn's bound the least one, and a real engine's uncached turns were cut.
FIRST_BYTE_OWN_RATES = 4
FIRST_BYTE_COLD_S_PER_TOKEN = 0.01
FIRST_BYTE_OVERHEAD_TOKENS = 256
FIRST_BYTE_FLOOR_S_PER_TOKEN = 0.0005
# Well before that bound a turn is reported *silent* when its replica has sent nothing
# (to any of this dataplane's turns there) for SILENT_BOUND_SHARE of the turn's bound as
# derived (before FIRST_BYTE_MIN_S), at least SILENT_MIN_S, since the turn was sent: the
# scheduler takes no new turns there until a byte comes from it; the turn itself goes on
# waiting up to its bound. A quarter of the derived bound is the recent rates' own
# prediction (the bound is FIRST_BYTE_MARGIN times it); 0.25 s is five times a quick
# engine's usual first byte, with no byte at all from the replica meanwhile.
SILENT_BOUND_SHARE = 0.25
SILENT_MIN_S = 0.25
# Until its first byte a waiting turn's bound is recomputed this often (the first
# answers of a cold pool tighten it); afterwards only when it could have passed.
FIRST_BYTE_RECHECK_S = 0.5
# A stream that stalls after bytes reached the client is continued on another replica
# if that replica takes continue_final_message (dataplane/continuation.py): whether it
# does is read from its /openapi.json, waiting at most this long (no answer: it does not).
CONTINUE_SUPPORT_TIMEOUT_S = 2.0
# A non-streamed reply whose request names no max_tokens is counted as this many tokens
# of work before its first byte (the whole reply comes at once).
REPLY_TOKENS_WITHOUT_MAX = 256
# A reply token is generated one decode step at a time, prompt tokens many to a step:
# a reply token counts as this many prompt tokens of work.
FIRST_BYTE_REPLY_WEIGHT = 10
# A reply whose request names its max_tokens is not cut off before max_tokens at this
# rate (5 tokens/s: a CPU engine decoding a full batch). A request naming none keeps the
# plain bound, so a wedged engine is still left within seconds.
FIRST_BYTE_REPLY_FLOOR_S_PER_TOKEN = 0.2
# A request body's bytes per prompt token, for the estimate above (JSON of English text).
BYTES_PER_TOKEN = 4
# Largest request body accepted (413 above it). Agent contexts are large; 32 MiB is ample.
MAX_BODY_BYTES = 32 * 1024 * 1024
# After a request that brought at least this many bytes the C heap is trimmed (dataplane/heap.py):
# a body this large leaves megabytes the allocator would keep; an agent's turn is rarely
# over 1 MiB (200k tokens of context are about 800 kB), so ordinary turns never cost a trim.
TRIM_AFTER_BYTES = 1024 * 1024
# ... this long after it ended: the requests of a burst ending within it share one trim.
TRIM_DELAY_S = 1.0

DEFAULT_PORT = 8080
DEFAULT_SCHEDULER_ADDR = "127.0.0.1:5000"
