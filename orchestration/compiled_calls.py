"""Compiled calls: a one-rank group's calls through a Ray compiled graph (cluster.compiled_calls).

A Ray actor call costs about 1.3 ms on a local cluster (the task's scheduling and messages);
the same call through a compiled graph about 0.45 ms: the arguments and the answer pass through
a shared-memory channel that the actor is already waiting on. A short step makes a few such
calls, so this is where Ray mode loses time against running in one process.

Each rank of a group built with `compiled_calls` gets a graph of one node, its host's
`fast_call(payload)`, compiled once its role is built. A call goes through the graph when
nothing in it needs Ray's task machinery (`plain_call`): no other call to wait for (`after`),
no ObjectRef among its arguments (an answer of another call, `ResultOf`, is read here first
when it came through a graph; one that came as a normal call's ref keeps the normal path).
Ray runs graph calls on a thread of their own beside the actor's normal calls, so the order
between the two kinds is kept here, per rank:

- a graph call is sent only once the rank's latest normal call has finished;
- a normal call first waits (in the driver) for the rank's graph calls still in flight.

Only groups of one rank use graphs: a call to several ranks waits for each rank's channel in
turn, which could not report a failed rank while another one waits for it in a collective
(the normal path watches every rank at once). A graph whose actor died, or whose call timed
out, is torn down; the group goes on with normal calls.
"""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray.dag import InputNode

# Graph calls a rank may have in flight; Ray's own bound is 10 (a further one raises).
MAX_IN_FLIGHT = 8


class FastCall:
    """A call in flight through a rank's graph. `wait` returns its answer (the tuple a normal
    call's ref resolves to) or raises its error, as often as asked."""

    def __init__(self, ref: Any, rank: int):
        self.ref, self.rank = ref, rank
        self._outcome: tuple[bool, Any] | None = None  # (succeeded, answer or exception)

    def wait(self, timeout: float | None) -> Any:
        if self._outcome is None:
            try:
                self._outcome = (True, self.ref.get(timeout=timeout))
            except TimeoutError:
                # Ray marks the ref as read before it waits; its answer is still to come.
                self.ref._ray_get_called = False
                raise
            except Exception as e:  # noqa: BLE001 - kept and raised to whoever waits
                self._outcome = (False, e)
        succeeded, value = self._outcome
        if succeeded:
            return value
        raise value

    def done(self) -> bool:
        """Whether `wait` would return (or raise) without waiting."""
        if self._outcome is None:
            try:
                self.wait(0)
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - done, with an error that `wait` raises again
                pass
        return True


def compile_rank(worker: Any) -> Any:
    """The graph of one rank: its host's fast_call, fed by the driver."""
    with InputNode() as payload:
        node = worker.fast_call.bind(payload)
    return node.experimental_compile()


def teardown(graph: Any) -> None:
    """Tear a rank's graph down, quietly where its actor is gone (Ray logs that as an error)."""
    log = logging.getLogger("ray.dag.compiled_dag_node")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        graph.teardown()
    except Exception:  # noqa: BLE001 - the actor is gone; nothing is left to release
        pass
    finally:
        log.setLevel(level)


def plain_call(args: tuple, kwargs: dict, deps: tuple) -> bool:
    """Whether a call can go through a graph: nothing to wait for, no ObjectRef to resolve."""
    return not deps and not any(isinstance(v, ray.ObjectRef) for v in (*args, *kwargs.values()))


def answer_of(handle: Any) -> Any:
    """What a call argument naming another call's answer becomes: a graph call's answer itself
    (read now), a normal call's ref as it is (Ray resolves it before the call runs)."""
    return handle.wait(None) if isinstance(handle, FastCall) else handle


def settle(deps: tuple) -> tuple:
    """The calls to wait for (`after`) that Ray can wait for: graph calls among them are waited for
    here. Their errors stay with them: whoever waits on their futures gets those."""
    for h in deps:
        if isinstance(h, FastCall):
            try:
                h.wait(None)
            except Exception:  # noqa: BLE001 - reported by the future's own get()
                pass
    return tuple(h for h in deps if not isinstance(h, FastCall))
