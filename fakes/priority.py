"""Priority scheduling as the real engines do it, each behind its own engine's flag and
off by default (without a flag a request's ``priority`` is ignored, as SGLang ignores it
unless ``--abort-on-priority-when-disabled``).

The fake's scheduler is SGLang's (:mod:`luftpause.fakes.sim`). Both engines' priority
semantics are modelled on top of it, and they differ, so the engine is started with one
of them or neither:

- **vLLM** (``--scheduling-policy priority``), :class:`VllmPriority`: vLLM V1's
  ``Scheduler.schedule()`` and ``PriorityRequestQueue``. The rest of the fake stays
  SGLang's (``PrefillAdder``'s admission accounting, chunked prefill, the radix cache);
  vLLM's own admission (a waiting request runs when its blocks can be allocated) is not
  modelled.
- **SGLang** (``--enable-priority-scheduling`` with ``--schedule-low-priority-values-first``,
  ``--priority-scheduling-preemption-threshold``, ``--disable-priority-preemption``),
  :class:`SglangPriority`: ``SchedulePolicy`` and ``PrefillAdder.preempt_to_schedule``.

The direction differs: in vLLM a *lower* value runs first; in SGLang a *higher* value
runs first unless ``--schedule-low-priority-values-first``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luftpause.fakes.sim import SimRequest

VLLM_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy choices the fake models


@dataclass(frozen=True)
class VllmPriority:
    """vLLM's ``--scheduling-policy priority``.

    Read in vLLM's source, https://github.com/vllm-project/vllm (the feature's PR:
    https://github.com/vllm-project/vllm/pull/19057, "Implement Priority Scheduling in V1
    Engine"; the request's ``priority`` field defaults to 0, and a non-zero one sent to an
    engine without the policy is refused there, which the fake does not do):

    - ``vllm/v1/core/sched/request_queue.py``, ``PriorityRequestQueue``: "requests with a
      smaller value of ``priority`` are processed first. If multiple requests have the same
      priority, the one with the earlier ``arrival_time`` is processed first"; a preempted
      request is pushed back into the heap by the same key (its arrival time unchanged).
    - ``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule()``: when a *running*
      request cannot get KV slots (``allocate_slots`` fails), the policy preempts
      ``max(self.running, key=lambda r: (r.priority, r.arrival_time))`` — the
      lowest-priority, latest-arrived running request, possibly the one being scheduled —
      frees its KV, resets its computed tokens and queues it again, until the slots fit.
      FCFS preempts the last running request instead.
    - Not merged upstream, so not modelled: a *waiting* request of higher priority does
      not preempt running ones when it cannot be scheduled; the waiting loop just stops
      (proposed in https://github.com/vllm-project/vllm/pull/45561 and
      https://github.com/vllm-project/vllm/pull/54530, both open; vLLM V0 did it, and
      sorted the running queue too, in https://github.com/vllm-project/vllm/pull/5958,
      gone with V0). V1 keeps ``running`` in admission order; priority decides only the
      preemption victim.

    In the fake the arrival time is the request's submission order (its id), and the
    decode step that finds no room for one token per running request (where SGLang's
    ``retract_decode`` would run) preempts by this rule instead, until one token per
    remaining request fits.
    """

    def effective(self, priority: int | None) -> int:
        return 0 if priority is None else priority

    @staticmethod
    def waiting_key(request: SimRequest) -> tuple[int, int]:
        return request.priority, request.id

    @staticmethod
    def victim(running: Sequence[SimRequest]) -> SimRequest:
        return max(running, key=lambda r: (r.priority, r.id))


@dataclass(frozen=True)
class SglangPriority:
    """SGLang's ``--enable-priority-scheduling``.

    Read in SGLang's source, https://github.com/sgl-project/sglang (the feature's PR:
    https://github.com/sgl-project/sglang/pull/8746, "priority based scheduling with
    priority based request acceptance and preemption"; the preemption toggle:
    https://github.com/sgl-project/sglang/pull/17026):

    - ``python/sglang/srt/server_args.py``: "Requests with higher priority integer values
      will be scheduled first by default"; ``--schedule-low-priority-values-first`` turns
      that round; ``--priority-scheduling-preemption-threshold`` (default 10) is the
      "minimum difference in priorities for an incoming request to have to preempt running
      request(s)"; preemption is on with priority scheduling unless
      ``--disable-priority-preemption`` (``Scheduler.enable_priority_preemption``).
    - ``python/sglang/srt/managers/scheduler.py``, ``_set_or_validate_priority``: a
      request without a priority gets the lowest one (``-sys.maxsize - 1``, or
      ``sys.maxsize`` with low values first).
    - ``python/sglang/srt/managers/schedule_policy.py``,
      ``SchedulePolicy._sort_by_priority_and_fcfs``: the waiting queue is sorted by
      ``(priority × sign, wait_queue_entry_time)`` before each prefill batch, sign −1 by
      default; the entry time is set whenever the request joins the queue (a retracted or
      preempted request joins it anew).
    - ``scheduler.py``, ``_get_new_batch_prefill_raw``: with preemption on, ``batch_is_full``
      is reset before each prefill batch; a waiting request met while the batch is full
      (its running requests at the request limit) calls ``PrefillAdder.preempt_to_schedule``
      and, if that fails, ends the batch. A refusal for lack of KV (``NO_TOKEN``) ends the
      batch without preempting.
    - ``schedule_policy.py``, ``PrefillAdder.preempt_to_schedule`` (:meth:`victims`): the
      running requests in order of ``(priority × −sign, −wait_queue_entry_time)`` (lowest
      priority first, the latest queued first among equals) are taken while the incoming
      request's priority exceeds theirs by more than the threshold, until the tokens they
      are expected to need (remaining ``max_new_tokens``, at most 4096, × ``new_token_ratio``)
      cover what the incoming request lacks; if they cannot, nothing is preempted. The
      victims' KV is released at once and they join the waiting queue after the batch.
    """

    low_values_first: bool = False
    threshold: int = 10
    preemption: bool = True

    @property
    def sign(self) -> int:
        return 1 if self.low_values_first else -1

    def effective(self, priority: int | None) -> int:
        if priority is not None:
            return priority
        return sys.maxsize if self.low_values_first else -sys.maxsize - 1

    def waiting_key(self, request: SimRequest) -> tuple[int, int]:
        return request.priority * self.sign, request.queued_seq

    def victims(self, request: SimRequest, running: Sequence[SimRequest], lacking: float,
                expected: Callable[[SimRequest], float]) -> list[SimRequest]:
        """``preempt_to_schedule``: the running requests to preempt so that ``request``,
        ``lacking`` tokens short, fits; [] when the threshold or the tokens rule it out."""
        ordered = sorted(running, key=lambda r: (r.priority * -self.sign, -r.queued_seq))
        chosen: list[SimRequest] = []
        for candidate in ordered:
            if (request.priority - candidate.priority) * -self.sign <= self.threshold:
                break
            chosen.append(candidate)
            lacking -= expected(candidate)
            if lacking <= 0:
                break
        return chosen if chosen and lacking <= 0 else []


PriorityPolicy = VllmPriority | SglangPriority
