"""Scheduling policies: the order in which waiting requests are admitted, and which running
request is preempted when blocks run out.

Add a policy here and name it in ``PagedConfig.scheduling_policy``.
"""

from __future__ import annotations

from .request import Request


class FCFS:
    """First come, first served: admitted in arrival order (a preempted request goes back to the
    front, having arrived before everything still waiting); the most recently admitted running
    request is preempted first."""

    name = "fcfs"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival, request.index)  # forked siblings follow their parent

    def victim(self, running: list[Request]) -> Request:
        return running[-1]  # ``running`` is in admission order


class Priority(FCFS):
    """Lower ``priority`` runs first, ties by arrival (vLLM's priority policy); the running request
    of the lowest priority (highest value), latest arrival, is preempted first."""

    name = "priority"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.priority, request.arrival, request.index)

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=self.key)


SchedulingPolicy = FCFS  # the interface: ``key`` orders the waiting queue, ``victim`` picks whom to preempt
POLICIES: dict[str, SchedulingPolicy] = {"fcfs": FCFS(), "priority": Priority()}
