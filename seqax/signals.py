"""How a run answers SIGTERM, the usual preemption notice (SLURM, Kubernetes, a cloud's spot VMs).
Before its training loop a run has no new step to save: it stops at once with one line and
SIGTERM_STATUS (every file on disk survives an exit at any moment). In the loop, PreemptionWatch
asks for a checkpoint after the current step, then the loop exits.

Only the standard library is imported here: train.py installs the first handler before it imports
jax, so that a SIGTERM during the imports gets the same line.
"""

import os
import signal
import threading

# The exit status of a process stopped by SIGTERM before its training loop began: 128 + SIGTERM,
# what a shell reports for a process that SIGTERM ended.
SIGTERM_STATUS = 128 + signal.SIGTERM
BEFORE_THE_LOOP = ("stopped by SIGTERM before the training loop, with no step to save; "
                   "a restart resumes from the newest checkpoint")


def exit_on_sigterm(signature=lambda: "seqax"):
    """Until a PreemptionWatch takes over, SIGTERM stops the program with one line (signed
    `signature()`) and SIGTERM_STATUS. (With several processes, JAX's preemption service takes
    SIGTERM over once the process has joined: the run then saves after its next step.)"""
    def on_sigterm(signum, frame):
        os.write(2, f"{signature()}: error: {BEFORE_THE_LOOP}\n".encode())
        os._exit(SIGTERM_STATUS)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


class PreemptionWatch:
    """SIGTERM asks the training loop to checkpoint and exit. With one process a handler sets a
    flag; with several, JAX's preemption service (which catches SIGTERM itself) picks a step at
    which every process answers True."""

    def __enter__(self):
        import jax  # here, not at the top: see the module's docstring

        self.processes = jax.process_count()
        self.requested = False
        self.previous = None
        if self.processes == 1 and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _on_sigterm(self, signum, frame):
        self.requested = True  # only a flag: the loop may be anywhere, even inside a print

    def reached(self, step: int) -> bool:
        """Whether the run stops after `step`: the loop then saves checkpoint step + 1 and exits."""
        if self.processes == 1:
            return self.requested
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
