"""The scheduler's constants, each with where it matters."""

from luftpause.vocabulary import RUN_IDLE_TIMEOUT_S

# Health + load probe period of every engine; also the probe's own timeout.
PROBE_PERIOD_S = 2.0
PROBE_TIMEOUT_S = 2.0
# After a (re)start, held turns wait for every replica's first probe (health and load),
# at most this long, so a pinned turn never moves because its replica was probed last.
FIRST_PROBE_WAIT_S = 2 * PROBE_TIMEOUT_S + 1.0
# A dataplane whose Connect (or Report) stream ended and did not come back within this long is gone:
# its in-flight turns are taken as failed (its runs keep their replica).
DATAPLANE_GONE_S = 5.0
# Clock tick that drives expiry.
CLOCK_TICK_S = 1.0
# A held turn whose model no replica in rotation serves (each unhealthy, stalled or
# silent) is answered after this long, from when the last one left rotation or from its
# arrival if later: a 503 with a Retry-After of a probe period, the soonest a replica
# can come back (core/stranded.py). Long enough to wait through a stalled replica's
# return (its next answered probe generation, a probe period or two) and a quick engine
# restart; short enough that a client is told, not left waiting on a pool that is gone.
HELD_WITHOUT_REPLICA_MS = 15_000
# A turn whose end was never reported is dropped and its slot freed.
TURN_TIMEOUT_MS = 10 * 60 * 1000
# A run with no turn for this long is forgotten; its next turn starts without affinity.
RUN_IDLE_TIMEOUT_MS = RUN_IDLE_TIMEOUT_S * 1000
# Affinity (core/placement.py) holds a run to its replica while that replica's recent
# turn time is under this many times a faster peer's: past it the run's next turn goes
# where turns are that much quicker (its prefix prefilled again there), and no slot of
# the slow replica is lent to dataplanes (they would keep the run there).
AFFINITY_SLOWER_FACTOR = 3

# The admission limit's increase per probe (core/limit.py): the
# requests that fit in this share of the engine's free KV, at most limit / divisor.
LIMIT_FREE_KV_SHARE = 0.5
# Probes in a row without an engine queue before the limit may grow; a decrease right
# after an increase doubles it up to LIMIT_CALM_MAX, and twice as many calm probes in a
# row halve it again.
LIMIT_CALM_PROBES = 2
# Slow start: a replica that reports load, shows no queue and has no decode ceiling takes
# at most this many turns (or those already there) until its limit grows.
LIMIT_INITIAL = 4
LIMIT_CALM_MAX = 8
# A turn placed on a replica less than this share of the replica's recent turn time before
# a probe may be waiting for the engine's next pass (an arrival, not a queue): an engine
# queue that only such turns can explain lowers nothing...
LIMIT_ARRIVAL_TURN_SHARE = 0.5
# ... unless one of this many probes before it saw such a queue too (with 2, glimpses of
# arrivals on a busy quick replica, one probe in five, cut its limit too often).
LIMIT_QUEUE_MEMORY = 1
# ... and not even then where the engine's queue-time histogram says the requests it
# scheduled since the probe before waited less than this many times what they wait at
# probes that show no queue of luftpause's (a pass, on an engine with room; a moving
# average, each such probe weighing LIMIT_CALM_WAIT_WEIGHT), and under the share above
# of a turn time: on a quick engine both are a few ms, a turn that waits for a slot in
# an engine at its capacity waits several times as long (bench-admission: 35-46 ms
# against 2-7 ms).
LIMIT_ARRIVAL_WAIT_FACTOR = 3
LIMIT_CALM_WAIT_WEIGHT = 0.25
LIMIT_MAX_STEP_DIVISOR = 2
# A queue of luftpause's turns in the engine lowers the limit towards what the engine
# serves, but by at most this factor at one probe (to limit // divisor): one probe's
# reading can be a moment of a burst (a quick replica taking a peer's load showed 1
# running beside 2 queued, and a cut to that 1 held batch at half its rate for 26 s);
# a queue that persists halves it again at the next probe.
LIMIT_MAX_CUT_DIVISOR = 2
# Patience: a decrease right after an increase multiplies the calm probes the next
# increase waits for by this (up to LIMIT_CALM_MAX); this many times as many calm probes
# in a row divide them by it again.
LIMIT_PATIENCE_FACTOR = 2
# Slow start: until the engine first shows a queue, the limit is multiplied by this at
# each calm probe at which turns wait.
LIMIT_SLOW_START_GROWTH = 2
# Slots kept under the decode ceiling for paused interactive runs (when the operator asks
# for them): at most 1/KEPT_SLOTS_CEILING_DIVISOR of the ceiling.
KEPT_SLOTS_CEILING_DIVISOR = 2
# A slot under the ceiling is kept for an interactive run paused on a tool while it is due
# (core/resume.py): from RESUME_LEAD_SLOT_FREES times the interval between slot frees on
# its replica before its expected return to as long after, that span bounded by these.
RESUME_LEAD_SLOT_FREES = 2
RESUME_LEAD_MIN_MS = 20
RESUME_LEAD_MAX_MS = 1000
# The moving average of interactive runs' tool pauses: weight 1/RESUME_PAUSE_WEIGHT.
RESUME_PAUSE_WEIGHT = 8
# Room kept under the learned limit for paused interactive runs: at most
# 1/KEPT_ROOM_LIMIT_DIVISOR of the limit.
KEPT_ROOM_LIMIT_DIVISOR = 2
# A batch turn whose run's context is at least 1/YIELD_CONTEXT_DIVISOR of the replica's KV
# pool waits while an interactive turn is in flight on its accelerator (placement.py).
YIELD_CONTEXT_DIVISOR = 8
# ... for at most this long from its arrival: then it goes as any batch turn would.
YIELD_WAIT_MAX_MS = 2000

# Lifting the decode ceiling (core/ceiling.py): above the engine's fast batch, turns are
# cheap while a generated token costs the device (1000 / its summed throughput) at most
# 1 + LIFT_TOLERANCE times what it does at the fast batch, medians of the readings. On the
# testbed, whose readings hold prefill passes and CPU time in proportion to the tokens,
# a larger batch without an eager step reads about as dear per token (3.0-3.5 ms per
# token at every batch), with the 20 ms eager step 20-35 % dearer; single readings vary
# by about ±20 %, and a host CPU stall can double one.
LIFT_TOLERANCE = 0.15
# Readings above the fast batch, at one lift, before it is judged (their median); the
# first probe after a change is not read (the batch is still filling).
LIFT_SAMPLES = 5
LIFT_SETTLE_PROBES = 1
# The reference is the median of this many recent readings at the fast batch; the
# first try waits for LIFT_REFERENCE_MIN of them (the first prompts' prefill burst
# under a new load makes a step read up to twice its length for the first ten or so).
LIFT_REFERENCE_SAMPLES = 8
LIFT_REFERENCE_MIN = 15
# Probes after a dear verdict before the next try (90 s: a try of a wall that is right
# costs every run on the replica its eager steps for about ten seconds); doubled after
# each dear verdict, up to the maximum.
LIFT_RETRY_PROBES = 45
LIFT_RETRY_MAX = 240
# Where the engine reports its execution counters, a reading above the fast batch needs
# at least this share of the interval's decode passes run eagerly (a mixed interval reads
# part of the eager step; one mostly under the fast batch says little about above it).
LIFT_EAGER_SHARE = 0.5
# The lifted ceiling: at most this many times the fast batch; each step adds half of it.
LIFT_MAX_FACTOR = 4
LIFT_STEP_DIVISOR = 2
# Where the engine reports its execution counters a reading is its own decode GPU time per
# token, with no prefill pass, neighbour or host CPU in it: the first try waits for
# LIFT_COUNTED_REFERENCE_MIN readings at the fast batch, a lift is judged on
# LIFT_COUNTED_SAMPLES readings, and each step adds the whole fast batch (an eager step is
# a cost per pass, spread over the batch: a 6 ms one costs a token as much at 12 as at 8
# and 16 % less at 16; the testbed's 20 ms one reads 22 % dearer at twice the fast batch). With the slower pace the ceiling reached the batch the engine
# serves a third of the way into a two-minute window.
LIFT_COUNTED_REFERENCE_MIN = 3
LIFT_COUNTED_SAMPLES = 2
LIFT_COUNTED_STEP_DIVISOR = 1
# A counted reading at the fast batch is one of the replica full: a mean batch of at least
# this share of the fast batch (a token at a batch of 5 costs 3.2 ms on the testbed, at 8
# 2.3: readings from the first prompts' ramp made the 20 ms eager step look cheap).
LIFT_COUNTED_FULL_SHARE = 0.875
# On counted readings a lift is cheap only where a token costs at most 1 - LIFT_COUNTED_GAIN
# times what it does at the fast batch: every run on the replica, the interactive ones
# included, pays for the larger batch in a longer step (2.4 times as long at 16 with the
# testbed's 20 ms eager step, which costs a token 22 % more there and 7 % less at 24), so a
# lift must buy throughput, not merely cost none (eager step 0: 33 % less at 16).
LIFT_COUNTED_GAIN = 0.1
# In the operator's throughput mode (LUFTPAUSE_LIFT_CEILING=throughput), a counted lift that
# buys less than that but costs a token at most LIFT_COUNTED_EXPLORE more than at the fast
# batch is kept, and tried a step higher while turns wait: an eager step is a cost per pass,
# so a 10 ms one costs a token 5 % less at 16 than at 8 and 17 % less at 20, where the
# engine's KV lets the peers run (a mean batch a request short of full reads a few per cent
# either way of that).
LIFT_COUNTED_EXPLORE = 0.05

# Leases (core/leases.py): a dataplane that asks while nothing is held is lent at
# most 1/LEASE_ROOM_DIVISOR of each replica's free room (the rest stays for other
# dataplanes and for the turns the scheduler places), at most LEASE_MAX_SLOTS per
# replica; a replica with neither a limit nor a ceiling counts LEASE_UNLIMITED_ROOM.
LEASE_ROOM_DIVISOR = 2
LEASE_MAX_SLOTS = 128
LEASE_UNLIMITED_ROOM = 16

DEFAULT_GRPC_PORT = 5000
DEFAULT_HTTP_PORT = 5001
