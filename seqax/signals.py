"""How a run answers SIGTERM, the usual preemption notice (SLURM, Kubernetes, a cloud's spot VMs),
and SIGINT, a user's Ctrl-C. In the training loop (PreemptionWatch) either one asks for a
checkpoint after the current step, then the loop exits and the run exits 0; a second Ctrl-C stops
the run at once. Outside the loop, before it (no new step to save) or after it (while the last
checkpoint commits and the files close), either signal stops the run at once with one line and
128 + the signal, what a shell reports for a process that the signal ended. Stopping at once
damages nothing on disk: a checkpoint counts only once committed whole, and a metrics line cut
short is dropped on resume.

Only the standard library is imported here: train.py installs the first handler before it imports
jax, so that a signal during the imports gets the same line.
"""

import os
import signal
import threading

from seqax.console import signature as process_signature

# The signals that stop a run, as its lines name them.
STOPPING = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}
# Whether a training loop has ended in this process (PreemptionWatch.__exit__), for the line of a
# signal outside the loop. Reset by exit_on_signal, which each program calls at its start.
_loop_ended = False


def stop_now(signature: str, line: str, signum: int):
    """Writes `signature: error: line` to stderr and exits with 128 + signum at once, from a signal
    handler: no print (the handler may run inside one), no clean-up."""
    os.write(2, f"{signature}: error: {line}\n".encode())
    os._exit(128 + signum)


def exit_on_signal(signature=lambda: "seqax"):
    """Until a PreemptionWatch takes over (and after it has ended), SIGTERM and SIGINT stop the
    program with one line (signed `signature()`) and 128 + the signal. (With several processes,
    JAX's preemption service takes SIGTERM over once the process has joined: the run then saves
    after its next step.)"""
    global _loop_ended
    _loop_ended = False

    def on_signal(signum, frame):
        when = ("as the run was ending (its last checkpoint may not have been committed)" if _loop_ended
                else "before the training loop, with no step to save")
        stop_now(signature(), f"stopped by {STOPPING[signum]} {when}; a restart resumes from the newest checkpoint",
                 signum)

    if threading.current_thread() is threading.main_thread():
        for signum in STOPPING:
            signal.signal(signum, on_signal)


class PreemptionWatch:
    """SIGTERM or a first Ctrl-C asks the training loop to checkpoint and exit; a second Ctrl-C
    stops the process at once. With one process a handler sets a flag; with several, JAX's
    preemption service (which catches SIGTERM itself) picks a step at which every process answers
    True, and a Ctrl-C is handed to it as a SIGTERM of this process."""

    def __enter__(self):
        import jax  # here, not at the top: see the module's docstring

        self.processes, self.signature = jax.process_count(), process_signature(jax.process_index())
        self.requested, self.interrupts = False, 0
        self.previous, self.delivered, self.previous_wakeup = {}, None, -1
        if threading.current_thread() is threading.main_thread():
            watched = STOPPING if self.processes == 1 else [signal.SIGINT]
            self.previous = {signum: signal.signal(signum, self._on_signal) for signum in watched}
            # Python runs a handler once for signals that arrive together (two Ctrl-C while the main thread is
            # in a device call); the wakeup fd gets a byte for every signal delivered, so each one is counted.
            self.delivered, written = os.pipe()
            for fd in (self.delivered, written):
                os.set_blocking(fd, False)
            self.written = written
            self.previous_wakeup = signal.set_wakeup_fd(written, warn_on_full_buffer=False)
        return self

    def _on_signal(self, signum, frame):
        if signum == signal.SIGINT:
            self.interrupts += max(1, self._delivered(signum))
            if self.interrupts > 1:
                stop_now(self.signature, "stopped by a second Ctrl-C (SIGINT), without saving the steps since the "
                         "newest checkpoint; a restart resumes from it", signum)
            if self.processes > 1:  # JAX's preemption service, which holds SIGTERM, has every process stop at one step
                os.kill(os.getpid(), signal.SIGTERM)
        self.requested = True  # only a flag: the loop may be anywhere, even inside a print

    def reached(self, step: int) -> bool:
        """Whether the run stops after `step`: the loop then saves checkpoint step + 1 and exits."""
        if self.processes == 1:
            return self.requested
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)

    def why(self) -> str:
        """Why the loop stops, for its line."""
        return "stopped by Ctrl-C (a second one stops at once, without saving)" if self.interrupts else "preempted"

    def _delivered(self, signum: int) -> int:
        """How many `signum` signals the wakeup fd has recorded since it was last read (0 where none is set)."""
        try:
            return os.read(self.delivered, 4096).count(bytes([signum])) if self.delivered is not None else 0
        except BlockingIOError:
            return 0

    def __exit__(self, *exc):
        global _loop_ended
        _loop_ended = True
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if self.delivered is not None:
            signal.set_wakeup_fd(self.previous_wakeup)
            os.close(self.delivered)
            os.close(self.written)
