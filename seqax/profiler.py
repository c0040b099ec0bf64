"""A profiler trace of a few training steps: jax.profiler's trace (perfetto_trace.json.gz and the
xplane) of the steps `steps` (usually the two after a process's first, which waits for
compilation), written to <run>/profile on process 0. The profile is optional: a trace that cannot
be started or written (a full disk, no permission) is one warning, and training goes on.
"""

import time

import jax

from seqax.console import first_line, warn


class ProfileWindow:
    """Traces the steps in `steps` (a range; empty: none). before_step starts the trace once the step
    before the first traced one has finished; after_step stops it once the last one has, and gives the
    time that step finished (stopping the trace takes seconds: a step's time must not include them);
    close() stops a trace that a run's end (or a preemption) interrupted."""

    def __init__(self, directory: str, steps: range):
        self.directory, self.steps, self.tracing = directory, steps, False

    def before_step(self, step: int, state):
        if self.steps and step == self.steps[0]:
            jax.block_until_ready(state)
            try:
                jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
                self.tracing = True
            except Exception as e:  # whatever kind the profiler raises: the profile is optional
                self.give_up(e)

    def after_step(self, step: int, metrics) -> float | None:
        """When `step` is the last traced one: waits for it, stops the trace and returns the
        time.perf_counter() at which the step had finished; else None."""
        if not (self.steps and step == self.steps[-1]):
            return None
        jax.block_until_ready(metrics)
        finished = time.perf_counter()
        if self.close():
            print(f"profile of steps {self.steps[0]}-{step} written to {self.directory} "
                  "(perfetto_trace.json.gz opens in https://ui.perfetto.dev)", flush=True)
        self.steps = range(0)
        return finished

    def close(self) -> bool:
        """Stops a running trace and writes it; whether one was written."""
        if not self.tracing:
            return False
        self.tracing = False
        try:
            jax.profiler.stop_trace()
            return True
        except Exception as e:  # RESOURCE_EXHAUSTED on a full disk, an OSError, ...: the profile is optional
            self.give_up(e)
            return False

    def give_up(self, error: Exception):
        first = first_line(error)
        warn(f"could not write the profile of steps {self.steps[0]}-{self.steps[-1]} to {self.directory}: {first}; "
             "training goes on without it (the profile is optional)")
        self.steps = range(0)


def steps_to_profile(start: int, steps: int, count: int) -> range:
    """The `count` steps after the first one of a process that starts at step `start` (the first
    waits for compilation), within a run of `steps` steps."""
    return range(start + 1, min(start + 1 + count, steps))
